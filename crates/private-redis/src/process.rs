//! Spawning redis-server and reading its output: the part every kind of private server
//! shares.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use crate::error::Error;

/// Environment variable naming the `redis-server` binary to use instead of the one found
/// on `PATH`.
pub const REDIS_SERVER_ENV: &str = "DISTLOCK_REDIS_SERVER";

/// Printed by redis-server once its listening sockets are open (7.2 appends the socket
/// type, hence a substring match).
pub(crate) const READY_MARKER: &str = "Ready to accept connections";
/// Printed by a Sentinel once its listening socket is open: before 7.2 Sentinel mode
/// never prints [`READY_MARKER`].
pub(crate) const SENTINEL_READY_MARKER: &str = "Sentinel ID is";
/// Printed (inside a longer line) when the port is taken.
const PORT_IN_USE_MARKER: &str = "Address already in use";
/// Generous because CI machines can be slow to fork and load the binary, and a persistent
/// server replays its append-only file first; a fresh server is ready in milliseconds.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on waiting for a process that closed stdout to be reaped, or for a log-draining
/// task to see end of file.
pub(crate) const EXIT_GRACE: Duration = Duration::from_secs(2);
const LOG_CAPACITY: usize = 50;

pub(crate) type LogBuffer = Arc<Mutex<VecDeque<String>>>;

/// Which binary to run, and whether the user chose it, which decides how a "not found" is
/// reported.
#[derive(Debug, Clone)]
pub(crate) struct Binary {
    path: PathBuf,
    from_env: bool,
}

impl Binary {
    pub(crate) fn from_env() -> Self {
        match std::env::var_os(REDIS_SERVER_ENV) {
            Some(path) if !path.is_empty() => Binary {
                path: PathBuf::from(path),
                from_env: true,
            },
            _ => Binary {
                path: PathBuf::from("redis-server"),
                from_env: false,
            },
        }
    }

    fn spawn_error(&self, source: io::Error) -> Error {
        match (source.kind(), self.from_env) {
            (io::ErrorKind::NotFound, true) => Error::RedisBinaryNotFound {
                path: self.path.clone(),
            },
            (io::ErrorKind::NotFound, false) => Error::RedisNotInstalled,
            _ => Error::Spawn {
                binary: self.path.clone(),
                source,
            },
        }
    }
}

/// How one launch of redis-server is set up.
pub(crate) struct Launch<'a> {
    pub binary: &'a Binary,
    pub port: u16,
    /// Every argument but the port, which changes between attempts.
    pub args: &'a [OsString],
    pub log: &'a LogBuffer,
    /// SIGKILL the server when the process that started it dies, even by kill -9.
    pub kill_on_drop: bool,
    /// Signal the server gets when the thread that spawned it ends (`PR_SET_PDEATHSIG`).
    pub parent_death_signal: Option<nix::sys::signal::Signal>,
    /// The output line (substring) that says the server accepts connections.
    pub ready_marker: &'static str,
}

pub(crate) struct Launched {
    pub child: Child,
    pub drains: Vec<JoinHandle<()>>,
}

/// A loopback port that was free a moment ago. Another process may take it first, so
/// callers that can retry should.
pub fn pick_free_port() -> Result<u16, Error> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(Error::io("probing for a free loopback port"))?;
    let port = listener
        .local_addr()
        .map_err(Error::io("reading the probed port"))?
        .port();
    // Dropped here so redis-server can bind the port; the race with other processes is
    // handled by retrying.
    drop(listener);
    Ok(port)
}

/// The arguments every private server gets: loopback only, its own directory, in the
/// foreground, logging to stdout (read to detect readiness).
pub(crate) fn base_args(dir: &Path) -> Vec<OsString> {
    vec![
        "--bind".into(),
        "127.0.0.1".into(),
        "--dir".into(),
        dir.as_os_str().to_owned(),
        "--daemonize".into(),
        "no".into(),
        "--logfile".into(),
        "".into(),
    ]
}

/// Spawns redis-server and waits for its readiness line.
pub(crate) async fn launch(launch: Launch<'_>) -> Result<Launched, Error> {
    let Launch {
        binary,
        port,
        args,
        log,
        kill_on_drop,
        parent_death_signal,
        ready_marker,
    } = launch;
    let mut command = Command::new(&binary.path);
    // A config file must come first, so the port goes after the rest.
    command
        .args(args)
        .arg("--port")
        .arg(port.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // Config errors ("FATAL CONFIG FILE ERROR") go to stderr; capture it so they end up
        // in our error messages.
        .stderr(Stdio::piped())
        .kill_on_drop(kill_on_drop);
    if let Some(signal) = parent_death_signal {
        let parent = nix::unistd::getpid();
        // SAFETY: the closure runs in the forked child before exec, where only
        // async-signal-safe calls are allowed; prctl, getppid and kill are plain system
        // calls that neither allocate nor take locks.
        unsafe {
            command.pre_exec(move || {
                nix::sys::prctl::set_pdeathsig(signal).map_err(io::Error::from)?;
                // The parent may have died between fork and prctl, in which case no signal
                // will ever come: deliver it now.
                if nix::unistd::getppid() != parent {
                    nix::sys::signal::raise(signal).map_err(io::Error::from)?;
                }
                Ok(())
            });
        }
    }
    let mut child = command
        .spawn()
        .map_err(|source| binary.spawn_error(source))?;

    let missing_pipe = |name: &str| Error::Io {
        context: format!("capturing redis-server {name}"),
        source: io::Error::other("pipe was not created"),
    };
    let stdout = child.stdout.take().ok_or_else(|| missing_pipe("stdout"))?;
    let stderr = child.stderr.take().ok_or_else(|| missing_pipe("stderr"))?;
    let stderr_drain = tokio::spawn(drain(BufReader::new(stderr), log.clone(), "stderr: "));

    let mut stdout = BufReader::new(stdout);
    match tokio::time::timeout(
        READY_TIMEOUT,
        wait_until_ready(&mut stdout, log, ready_marker),
    )
    .await
    {
        Ok(Ok(true)) => {
            let stdout_drain = tokio::spawn(drain(stdout, log.clone(), ""));
            Ok(Launched {
                child,
                drains: vec![stdout_drain, stderr_drain],
            })
        }
        Ok(Ok(false)) => {
            // Stdout closed: the process is exiting. Reap it for the status and let stderr
            // finish so the output explains why.
            let status = match tokio::time::timeout(EXIT_GRACE, child.wait()).await {
                Ok(Ok(status)) => status.to_string(),
                Ok(Err(err)) => format!("exit status unavailable: {err}"),
                Err(_) => {
                    let _ = child.kill().await;
                    "closed stdout but kept running; killed".to_owned()
                }
            };
            finish_drain(stderr_drain).await;
            Err(Error::ServerExited {
                port,
                status,
                output: log_text(log),
            })
        }
        Ok(Err(source)) => {
            let _ = child.kill().await;
            stderr_drain.abort();
            Err(Error::Io {
                context: "reading redis-server output".to_owned(),
                source,
            })
        }
        Err(_elapsed) => {
            let _ = child.kill().await;
            finish_drain(stderr_drain).await;
            Err(Error::StartTimeout {
                port,
                timeout: READY_TIMEOUT,
                output: log_text(log),
            })
        }
    }
}

/// Reads lines into the log until the readiness line (`true`) or end of file (`false`).
async fn wait_until_ready<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    log: &LogBuffer,
    ready_marker: &str,
) -> io::Result<bool> {
    let mut buf = Vec::new();
    while let Some(line) = next_line(reader, &mut buf).await? {
        let ready = line.contains(ready_marker);
        push_line(log, line);
        if ready {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Copies lines into the log until end of file. Runs for the life of the process because
/// an unread pipe eventually fills and blocks redis-server's logging, which would freeze
/// the server.
async fn drain<R: AsyncBufRead + Unpin>(mut reader: R, log: LogBuffer, prefix: &'static str) {
    let mut buf = Vec::new();
    while let Ok(Some(line)) = next_line(&mut reader, &mut buf).await {
        push_line(&log, format!("{prefix}{line}"));
    }
}

/// One line, decoded lossily: a stray non-UTF-8 byte must not stop the drain (and with it
/// the server).
async fn next_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    buf: &mut Vec<u8>,
) -> io::Result<Option<String>> {
    buf.clear();
    if reader.read_until(b'\n', buf).await? == 0 {
        return Ok(None);
    }
    let line = String::from_utf8_lossy(buf);
    Ok(Some(line.trim_end_matches(['\n', '\r']).to_owned()))
}

pub(crate) async fn finish_drain(mut drain: JoinHandle<()>) {
    if tokio::time::timeout(EXIT_GRACE, &mut drain).await.is_err() {
        // Something (a forked child) still holds the pipe open; stop reading.
        drain.abort();
    }
}

pub(crate) fn push_line(log: &LogBuffer, line: String) {
    tracing::trace!(target: "private_redis", "{line}");
    let mut log = lock_log(log);
    if log.len() == LOG_CAPACITY {
        log.pop_front();
    }
    log.push_back(line);
}

pub(crate) fn lock_log(log: &LogBuffer) -> MutexGuard<'_, VecDeque<String>> {
    // Poisoning can only interrupt a push/pop, which leaves the deque valid; diagnostics
    // must stay available even after a panic.
    log.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn log_text(log: &LogBuffer) -> String {
    lock_log(log)
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join("\n")
}

/// The output of a launch that failed because its port was taken.
pub(crate) fn port_conflict_output(err: &Error) -> Option<&str> {
    match err {
        Error::ServerExited { output, .. } if output.contains(PORT_IN_USE_MARKER) => Some(output),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_default_binary_is_reported_as_not_installed() {
        let binary = Binary {
            path: PathBuf::from("redis-server"),
            from_env: false,
        };
        let err = binary.spawn_error(io::Error::from(io::ErrorKind::NotFound));
        assert!(matches!(err, Error::RedisNotInstalled));
        assert!(err.to_string().contains("apt-get install redis-server"));
    }

    #[tokio::test]
    async fn missing_override_binary_names_the_path() -> Result<(), Error> {
        let dir = tempfile::tempdir().map_err(Error::io("creating temp dir"))?;
        let path = dir.path().join("no-such-redis-server");
        let binary = Binary {
            path: path.clone(),
            from_env: true,
        };
        let log = LogBuffer::default();
        let launched = launch(Launch {
            binary: &binary,
            port: 1,
            args: &base_args(dir.path()),
            log: &log,
            kill_on_drop: true,
            parent_death_signal: None,
            ready_marker: READY_MARKER,
        })
        .await;
        match launched {
            Err(Error::RedisBinaryNotFound { path: reported }) => assert_eq!(reported, path),
            Err(other) => panic!("expected RedisBinaryNotFound, got {other}"),
            Ok(_) => panic!("a nonexistent binary was spawned"),
        }
        Ok(())
    }

    #[test]
    fn log_keeps_only_the_newest_lines() {
        let log = LogBuffer::default();
        for i in 0..LOG_CAPACITY + 5 {
            push_line(&log, i.to_string());
        }
        let lines: Vec<String> = lock_log(&log).iter().cloned().collect();
        assert_eq!(lines.len(), LOG_CAPACITY);
        assert_eq!(lines.first().map(String::as_str), Some("5"));
    }
}
