//! A real `redis-server` process for tests.
//!
//! Each [`RedisServer`] runs its own `redis-server` on a private loopback
//! port with a private working directory and persistence disabled, so tests
//! can run in parallel without sharing state. The harness can pause
//! (SIGSTOP), resume, kill and restart the process to reproduce the failures
//! a distributed lock has to survive.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::fmt;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nix::sys::signal::{kill as send_signal, Signal};
use nix::unistd::Pid;
use tempfile::TempDir;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;

use crate::error::TestkitError;

/// Environment variable naming the `redis-server` binary to use instead of
/// the one found on `PATH`.
pub const REDIS_SERVER_ENV: &str = "DISTLOCK_REDIS_SERVER";

/// Printed by redis-server once its listening sockets are open (7.2 appends
/// the socket type, hence a substring match).
const READY_MARKER: &str = "Ready to accept connections";
/// Printed (inside a longer line) when the port is taken.
const PORT_IN_USE_MARKER: &str = "Address already in use";
/// Generous because CI machines can be slow to fork and load the binary; a
/// healthy server is ready in a few milliseconds.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on waiting for a process that closed stdout to be reaped, or for a
/// log-draining task to see end of file.
const EXIT_GRACE: Duration = Duration::from_secs(2);
const LOG_CAPACITY: usize = 50;
/// A fresh port is picked per attempt; another process can grab it between
/// our probe and redis-server's bind, but rarely twice in a row.
const FRESH_PORT_ATTEMPTS: u32 = 5;
/// On restart the port must stay the same, so wait for it instead of
/// switching. redis-server sets SO_REUSEADDR, so TIME_WAIT alone does not
/// block it; this covers a stranger briefly taking the port.
const RESTART_BIND_ATTEMPTS: u32 = 20;
const RESTART_BIND_BACKOFF: Duration = Duration::from_millis(100);

type LogBuffer = Arc<Mutex<VecDeque<String>>>;

/// A `redis-server` process owned by the test.
///
/// The server listens on `127.0.0.1` only, keeps its files in a private
/// temporary directory, and persists nothing (`--save ""`, `--appendonly
/// no`). Dropping the value kills the process and deletes the directory.
///
/// Its output is drained continuously (so the pipe never fills and blocks
/// the server) and the last lines are kept for diagnostics, see
/// [`recent_log`](Self::recent_log).
pub struct RedisServer {
    port: u16,
    binary: Binary,
    extra_args: Vec<String>,
    log: LogBuffer,
    /// Atomic because `pause`/`resume` take `&self`, so a shared server can
    /// be paused from a test while other tasks use it.
    paused: AtomicBool,
    child: Option<Child>,
    drains: Vec<JoinHandle<()>>,
    dir: TempDir,
}

impl fmt::Debug for RedisServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisServer")
            .field("port", &self.port)
            .field("pid", &self.pid())
            .field("paused", &self.paused.load(Ordering::SeqCst))
            .field("dir", &self.dir.path())
            .finish_non_exhaustive()
    }
}

impl RedisServer {
    /// Starts a `redis-server` on a free loopback port and waits until it
    /// accepts connections.
    ///
    /// The binary is taken from the `DISTLOCK_REDIS_SERVER` environment
    /// variable if set, otherwise `redis-server` from `PATH`.
    pub async fn start() -> Result<RedisServer, TestkitError> {
        Self::start_with_args(&[]).await
    }

    /// Like [`start`](Self::start), with `extra` appended to the
    /// redis-server command line (e.g. `&["--maxmemory", "10mb"]`). Later
    /// arguments override earlier ones, so these can override the defaults.
    /// They are reused by [`restart`](Self::restart).
    pub async fn start_with_args(extra: &[&str]) -> Result<RedisServer, TestkitError> {
        let binary = Binary::from_env();
        let extra_args: Vec<String> = extra.iter().map(|arg| (*arg).to_owned()).collect();
        let dir = tempfile::Builder::new()
            .prefix("distlock-redis-")
            .tempdir()
            .map_err(TestkitError::io(
                "creating a temporary directory for redis-server",
            ))?;

        let mut last_conflict = None;
        for _ in 0..FRESH_PORT_ATTEMPTS {
            let port = pick_free_port()?;
            // A fresh log per attempt so a successful server's diagnostics
            // are not cluttered by a failed neighbour's.
            let log = LogBuffer::default();
            match launch(&binary, port, dir.path(), &extra_args, &log).await {
                Ok(launched) => {
                    tracing::debug!(port, pid = ?launched.child.id(), "redis-server ready");
                    return Ok(RedisServer {
                        port,
                        binary,
                        extra_args,
                        log,
                        paused: AtomicBool::new(false),
                        child: Some(launched.child),
                        drains: launched.drains,
                        dir,
                    });
                }
                Err(err) => match port_conflict_output(&err) {
                    Some(output) => {
                        tracing::debug!(port, "port taken before redis-server bound it; retrying");
                        last_conflict = Some((port, output.to_owned()));
                    }
                    None => return Err(err),
                },
            }
        }
        let (port, output) = last_conflict.unwrap_or_default();
        Err(TestkitError::PortUnavailable {
            port,
            attempts: FRESH_PORT_ATTEMPTS,
            output,
        })
    }

    /// The TCP port the server listens on (stable across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Connection URL, `redis://127.0.0.1:{port}/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Process id of the running server; `None` after [`kill`](Self::kill).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// A client for this server. Creating it does not connect.
    pub fn client(&self) -> Result<redis::Client, TestkitError> {
        Ok(redis::Client::open(self.url())?)
    }

    /// Opens a new multiplexed connection to this server.
    pub async fn connection(&self) -> Result<redis::aio::MultiplexedConnection, TestkitError> {
        Ok(self.client()?.get_multiplexed_async_connection().await?)
    }

    /// Freezes the server with SIGSTOP, simulating a stop-the-world pause or
    /// an unreachable node: connections stay open but nothing is answered.
    ///
    /// The kernel acts on a pending SIGSTOP before the process runs any more
    /// user code, so once this returns the server will not answer again
    /// until [`resume`](Self::resume). Time keeps passing for everyone else,
    /// which is the point: leases expire while the server is frozen.
    pub fn pause(&self) -> Result<(), TestkitError> {
        self.signal(Signal::SIGSTOP)?;
        self.paused.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Continues a server frozen by [`pause`](Self::pause) (SIGCONT).
    /// Harmless on a server that is not paused.
    pub fn resume(&self) -> Result<(), TestkitError> {
        self.signal(Signal::SIGCONT)?;
        self.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Kills the server with SIGKILL, simulating a crash, and waits until the
    /// process has exited. Does nothing if it is not running.
    pub async fn kill(&mut self) -> Result<(), TestkitError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // SIGKILL also ends a stopped process, so a paused server needs no
        // SIGCONT first.
        child
            .kill()
            .await
            .map_err(TestkitError::io("killing redis-server"))?;
        self.paused.store(false, Ordering::SeqCst);
        // Let the drains read the last output so `recent_log` is complete.
        for drain in self.drains.drain(..) {
            finish_drain(drain).await;
        }
        Ok(())
    }

    /// Kills the server if it is running, then starts a new one on the same
    /// port, in the same directory, with the same arguments, and waits until
    /// it accepts connections.
    ///
    /// Persistence is disabled, so **all data is lost**: the new server
    /// starts empty, like a master that crashed before persisting (or a
    /// failover to a replica that had not received the latest writes).
    /// Existing connections are broken; open new ones.
    pub async fn restart(&mut self) -> Result<(), TestkitError> {
        self.kill().await?;
        push_line(
            &self.log,
            format!(
                "[distlock-testkit] restarting redis-server on port {}",
                self.port
            ),
        );
        let mut last_output = String::new();
        for attempt in 1..=RESTART_BIND_ATTEMPTS {
            match launch(
                &self.binary,
                self.port,
                self.dir.path(),
                &self.extra_args,
                &self.log,
            )
            .await
            {
                Ok(launched) => {
                    tracing::debug!(port = self.port, attempt, "redis-server restarted");
                    self.child = Some(launched.child);
                    self.drains = launched.drains;
                    return Ok(());
                }
                Err(err) => match port_conflict_output(&err) {
                    Some(output) => {
                        last_output = output.to_owned();
                        tokio::time::sleep(RESTART_BIND_BACKOFF).await;
                    }
                    None => return Err(err),
                },
            }
        }
        Err(TestkitError::PortUnavailable {
            port: self.port,
            attempts: RESTART_BIND_ATTEMPTS,
            output: last_output,
        })
    }

    /// The last lines (up to 50) the server wrote to stdout and stderr,
    /// oldest first. Stderr lines are prefixed with `stderr: `.
    pub fn recent_log(&self) -> Vec<String> {
        lock_log(&self.log).iter().cloned().collect()
    }

    /// Runs `INFO commandstats` and returns the number of calls per command,
    /// e.g. `"evalsha" -> 12`. Subcommands appear as `"client|setinfo"`.
    /// Counters only include commands since the last start or
    /// `CONFIG RESETSTAT`.
    pub async fn info_commandstats(&self) -> Result<HashMap<String, u64>, TestkitError> {
        let mut conn = self.connection().await?;
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await?;
        parse_commandstats(&info)
    }

    fn signal(&self, signal: Signal) -> Result<(), TestkitError> {
        let pid = self.pid().ok_or(TestkitError::NotRunning)?;
        let signal_error = |source| TestkitError::Signal {
            signal: signal.as_str(),
            pid,
            source,
        };
        let raw = i32::try_from(pid).map_err(|_| signal_error(nix::Error::EINVAL))?;
        send_signal(Pid::from_raw(raw), signal).map_err(signal_error)
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // SIGKILL would end a stopped process anyway; resuming first makes
        // sure that, should the kill below fail, no frozen redis-server is
        // left behind holding its port.
        if self.paused.load(Ordering::SeqCst) {
            let _ = self.resume();
        }
        if let Some(child) = self.child.as_mut() {
            // Errors mean the process is already gone. The reaping is left to
            // tokio (and kill_on_drop would send SIGKILL anyway); blocking
            // here could stall a runtime thread.
            let _ = child.start_kill();
        }
        for drain in &self.drains {
            drain.abort();
        }
    }
}

/// Which binary to run, and whether the user chose it, which decides how a
/// "not found" is reported.
#[derive(Debug, Clone)]
struct Binary {
    path: PathBuf,
    from_env: bool,
}

impl Binary {
    fn from_env() -> Self {
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

    fn spawn_error(&self, source: io::Error) -> TestkitError {
        match (source.kind(), self.from_env) {
            (io::ErrorKind::NotFound, true) => TestkitError::RedisBinaryNotFound {
                path: self.path.clone(),
            },
            (io::ErrorKind::NotFound, false) => TestkitError::RedisNotInstalled,
            _ => TestkitError::Spawn {
                binary: self.path.clone(),
                source,
            },
        }
    }
}

struct Launched {
    child: Child,
    drains: Vec<JoinHandle<()>>,
}

/// A loopback port that was free a moment ago: for servers a test starts itself (a TLS
/// port, a listener that is not Redis). Another process may take it first, so callers
/// that can retry should.
pub fn pick_free_port() -> Result<u16, TestkitError> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .map_err(TestkitError::io("probing for a free loopback port"))?;
    let port = listener
        .local_addr()
        .map_err(TestkitError::io("reading the probed port"))?
        .port();
    // Dropped here so redis-server can bind the port; the race with other
    // processes is handled by retrying in `start_with_args`.
    drop(listener);
    Ok(port)
}

fn server_args(port: u16, dir: &Path, extra: &[String]) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec![
        "--port".into(),
        port.to_string().into(),
        "--bind".into(),
        "127.0.0.1".into(),
        "--dir".into(),
        dir.as_os_str().to_owned(),
        "--save".into(),
        "".into(),
        "--appendonly".into(),
        "no".into(),
        "--daemonize".into(),
        "no".into(),
        "--protected-mode".into(),
        "no".into(),
        // Empty logfile means stdout, which we read to detect readiness.
        "--logfile".into(),
        "".into(),
    ];
    args.extend(extra.iter().map(OsString::from));
    args
}

/// Spawns redis-server and waits for its readiness line.
async fn launch(
    binary: &Binary,
    port: u16,
    dir: &Path,
    extra: &[String],
    log: &LogBuffer,
) -> Result<Launched, TestkitError> {
    let mut child = Command::new(&binary.path)
        .args(server_args(port, dir, extra))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // Config errors ("FATAL CONFIG FILE ERROR") go to stderr; capture it
        // so they end up in our error messages.
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|source| binary.spawn_error(source))?;

    let missing_pipe = |name: &str| TestkitError::Io {
        context: format!("capturing redis-server {name}"),
        source: io::Error::other("pipe was not created"),
    };
    let stdout = child.stdout.take().ok_or_else(|| missing_pipe("stdout"))?;
    let stderr = child.stderr.take().ok_or_else(|| missing_pipe("stderr"))?;
    let stderr_drain = tokio::spawn(drain(BufReader::new(stderr), log.clone(), "stderr: "));

    let mut stdout = BufReader::new(stdout);
    match tokio::time::timeout(READY_TIMEOUT, wait_until_ready(&mut stdout, log)).await {
        Ok(Ok(true)) => {
            let stdout_drain = tokio::spawn(drain(stdout, log.clone(), ""));
            Ok(Launched {
                child,
                drains: vec![stdout_drain, stderr_drain],
            })
        }
        Ok(Ok(false)) => {
            // Stdout closed: the process is exiting. Reap it for the status
            // and let stderr finish so the output explains why.
            let status = match tokio::time::timeout(EXIT_GRACE, child.wait()).await {
                Ok(Ok(status)) => status.to_string(),
                Ok(Err(err)) => format!("exit status unavailable: {err}"),
                Err(_) => {
                    let _ = child.kill().await;
                    "closed stdout but kept running; killed".to_owned()
                }
            };
            finish_drain(stderr_drain).await;
            Err(TestkitError::ServerExited {
                port,
                status,
                output: log_text(log),
            })
        }
        Ok(Err(source)) => {
            let _ = child.kill().await;
            stderr_drain.abort();
            Err(TestkitError::Io {
                context: "reading redis-server output".to_owned(),
                source,
            })
        }
        Err(_elapsed) => {
            let _ = child.kill().await;
            finish_drain(stderr_drain).await;
            Err(TestkitError::StartTimeout {
                port,
                timeout: READY_TIMEOUT,
                output: log_text(log),
            })
        }
    }
}

/// Reads lines into the log until the readiness line (`true`) or end of
/// file (`false`).
async fn wait_until_ready<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    log: &LogBuffer,
) -> io::Result<bool> {
    let mut buf = Vec::new();
    while let Some(line) = next_line(reader, &mut buf).await? {
        let ready = line.contains(READY_MARKER);
        push_line(log, line);
        if ready {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Copies lines into the log until end of file. Runs for the life of the
/// process because an unread pipe eventually fills and blocks redis-server's
/// logging, which would freeze the server.
async fn drain<R: AsyncBufRead + Unpin>(mut reader: R, log: LogBuffer, prefix: &'static str) {
    let mut buf = Vec::new();
    while let Ok(Some(line)) = next_line(&mut reader, &mut buf).await {
        push_line(&log, format!("{prefix}{line}"));
    }
}

/// One line, decoded lossily: a stray non-UTF-8 byte must not stop the
/// drain (and with it the server).
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

async fn finish_drain(mut drain: JoinHandle<()>) {
    if tokio::time::timeout(EXIT_GRACE, &mut drain).await.is_err() {
        // Something (a forked child) still holds the pipe open; stop reading.
        drain.abort();
    }
}

fn push_line(log: &LogBuffer, line: String) {
    tracing::trace!(target: "distlock_testkit::redis_server", "{line}");
    let mut log = lock_log(log);
    if log.len() == LOG_CAPACITY {
        log.pop_front();
    }
    log.push_back(line);
}

fn lock_log(log: &LogBuffer) -> MutexGuard<'_, VecDeque<String>> {
    // Poisoning can only interrupt a push/pop, which leaves the deque valid;
    // diagnostics must stay available even after a panic.
    log.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn log_text(log: &LogBuffer) -> String {
    lock_log(log)
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .join("\n")
}

fn port_conflict_output(err: &TestkitError) -> Option<&str> {
    match err {
        TestkitError::ServerExited { output, .. } if output.contains(PORT_IN_USE_MARKER) => {
            Some(output)
        }
        _ => None,
    }
}

/// Parses `cmdstat_<name>:calls=<n>,usec=...` lines of `INFO commandstats`.
fn parse_commandstats(info: &str) -> Result<HashMap<String, u64>, TestkitError> {
    let mut stats = HashMap::new();
    for line in info.lines() {
        let Some(rest) = line.trim_end().strip_prefix("cmdstat_") else {
            continue;
        };
        let malformed =
            || TestkitError::UnexpectedReply(format!("INFO commandstats line `{line}`"));
        let (name, fields) = rest.split_once(':').ok_or_else(malformed)?;
        let calls = fields
            .split(',')
            .find_map(|field| field.strip_prefix("calls="))
            .ok_or_else(malformed)?
            .parse::<u64>()
            .map_err(|_| malformed())?;
        stats.insert(name.to_owned(), calls);
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_commandstats() -> Result<(), TestkitError> {
        let info = "# Commandstats\r\n\
            cmdstat_evalsha:calls=12,usec=340,usec_per_call=28.33,rejected_calls=0,failed_calls=0\r\n\
            cmdstat_client|setinfo:calls=2,usec=3,usec_per_call=1.50,rejected_calls=0,failed_calls=0\r\n";
        let stats = parse_commandstats(info)?;
        assert_eq!(stats.len(), 2);
        assert_eq!(stats.get("evalsha"), Some(&12));
        assert_eq!(stats.get("client|setinfo"), Some(&2));
        Ok(())
    }

    #[test]
    fn rejects_malformed_commandstats() {
        let result = parse_commandstats("cmdstat_get:usec=3\r\n");
        assert!(
            matches!(result, Err(TestkitError::UnexpectedReply(_))),
            "{result:?}"
        );
    }

    #[test]
    fn missing_default_binary_is_reported_as_not_installed() {
        let binary = Binary {
            path: PathBuf::from("redis-server"),
            from_env: false,
        };
        let err = binary.spawn_error(io::Error::from(io::ErrorKind::NotFound));
        assert!(matches!(err, TestkitError::RedisNotInstalled));
        assert!(err.to_string().contains("apt-get install redis-server"));
    }

    #[tokio::test]
    async fn missing_override_binary_names_the_path() -> Result<(), TestkitError> {
        let dir = tempfile::tempdir().map_err(TestkitError::io("creating temp dir"))?;
        let path = dir.path().join("no-such-redis-server");
        let binary = Binary {
            path: path.clone(),
            from_env: true,
        };
        let log = LogBuffer::default();
        match launch(&binary, 1, dir.path(), &[], &log).await {
            Err(TestkitError::RedisBinaryNotFound { path: reported }) => {
                assert_eq!(reported, path)
            }
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
