//! [`PrivateRedis`]: one redis-server process owned by this process.

use std::ffi::OsString;
use std::fmt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::scratch::ScratchDir;
use nix::sys::signal::{kill as send_signal, Signal};
use nix::unistd::Pid;
use tokio::process::Child;
use tokio::task::JoinHandle;

use crate::data_dir::{stop_stale_server, DirLock};
use crate::error::Error;
use crate::process::{
    base_args, finish_drain, launch, lock_log, pick_free_port, port_conflict_output, push_line,
    Binary, Launch, LogBuffer, READY_MARKER, SENTINEL_READY_MARKER,
};

/// A fresh port is picked per attempt; another process can grab it between our probe and
/// redis-server's bind, but rarely twice in a row.
const FRESH_PORT_ATTEMPTS: u32 = 5;
/// On restart the port must stay the same, so wait for it instead of switching.
/// redis-server sets SO_REUSEADDR, so TIME_WAIT alone does not block it; this covers a
/// stranger briefly taking the port.
const RESTART_BIND_ATTEMPTS: u32 = 20;
const RESTART_BIND_BACKOFF: Duration = Duration::from_millis(100);
/// How long [`PrivateRedis::stop`] waits after SIGTERM before it sends SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Names inside a persistent data directory.
const LOCK_FILE: &str = "LOCK";
const PID_FILE: &str = "redis-server.pid";
const CONFIG_FILE: &str = "private.conf";
/// The config file of an ephemeral Sentinel, inside its directory.
const SENTINEL_CONFIG_FILE: &str = "sentinel.conf";

/// Where the server keeps its files, and what that implies.
enum Data {
    /// A temporary directory, removed on drop (or by a later start, if its owner was
    /// killed); nothing is persisted.
    Ephemeral(ScratchDir),
    /// A directory kept across restarts, with an append-only file, held exclusively.
    Persistent {
        dir: PathBuf,
        password: String,
        _lock: DirLock,
    },
}

/// How to start a [`PrivateRedis`]; see [`PrivateRedis::ephemeral`] and
/// [`PrivateRedis::persistent`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `start` is called"]
pub struct Builder {
    persistent_dir: Option<PathBuf>,
    extra_args: Vec<String>,
    parent_death_signal: Option<Signal>,
    sentinel_config: Option<String>,
}

impl Builder {
    /// Runs the process as a Redis Sentinel (`redis-server <config> --sentinel`) instead of
    /// a data server. `config` is the text of its configuration file (`sentinel monitor
    /// ...` and the like); it is written into the server's directory and passed first on
    /// the command line, because Sentinel refuses to start without a config file it can
    /// rewrite. Readiness is Sentinel's "Sentinel ID is" line, since Sentinel mode does
    /// not print redis-server's.
    pub fn sentinel(mut self, config: impl Into<String>) -> Self {
        self.sentinel_config = Some(config.into());
        self
    }

    /// Appends `args` to the redis-server command line. Later arguments override earlier
    /// ones, so these can override the defaults. They are reused by
    /// [`restart`](PrivateRedis::restart).
    pub fn args(mut self, args: &[&str]) -> Self {
        self.extra_args
            .extend(args.iter().map(|arg| (*arg).to_owned()));
        self
    }

    /// Whether the server is stopped (SIGTERM, so it finishes its append-only file) when
    /// this process dies, kill -9 included. On by default for a persistent server.
    ///
    /// Linux delivers the signal when the *thread* that started the server ends, so start
    /// it from a thread that lives as long as the server: the main thread, or a worker of
    /// a runtime that outlives it (not a `spawn_blocking` task, whose thread can end while
    /// idle).
    pub fn die_with_parent(mut self, enabled: bool) -> Self {
        self.parent_death_signal = enabled.then_some(Signal::SIGTERM);
        self
    }

    /// Starts the server on a free loopback port and waits until it accepts connections.
    ///
    /// For a persistent server this first takes the directory's lock (failing with
    /// [`Error::InUse`] when another process holds it) and stops a server an earlier owner
    /// left running there.
    pub async fn start(self) -> Result<PrivateRedis, Error> {
        let data = match &self.persistent_dir {
            None => Data::Ephemeral(ScratchDir::new("private-redis-")?),
            Some(dir) => open_persistent(dir).await?,
        };
        let args = server_args(&data, &self.extra_args, self.sentinel_config.as_deref())?;
        let binary = Binary::from_env();
        let mut server = PrivateRedis {
            port: 0,
            binary,
            args,
            kill_on_drop: matches!(data, Data::Ephemeral(_)),
            parent_death_signal: self.parent_death_signal,
            ready_marker: if self.sentinel_config.is_some() {
                SENTINEL_READY_MARKER
            } else {
                READY_MARKER
            },
            log: LogBuffer::default(),
            paused: AtomicBool::new(false),
            child: None,
            drains: Vec::new(),
            data,
        };
        let mut last_conflict = None;
        for _ in 0..FRESH_PORT_ATTEMPTS {
            server.port = pick_free_port()?;
            // A fresh log per attempt so a successful server's diagnostics are not
            // cluttered by a failed neighbour's.
            server.log = LogBuffer::default();
            match server.launch().await {
                Ok(()) => {
                    tracing::debug!(port = server.port, pid = ?server.pid(), "redis-server ready");
                    return Ok(server);
                }
                Err(err) => match port_conflict_output(&err) {
                    Some(output) => {
                        tracing::debug!(
                            port = server.port,
                            "port taken before redis-server bound it; retrying"
                        );
                        last_conflict = Some((server.port, output.to_owned()));
                    }
                    None => return Err(err),
                },
            }
        }
        let (port, output) = last_conflict.unwrap_or_default();
        Err(Error::PortUnavailable {
            port,
            attempts: FRESH_PORT_ATTEMPTS,
            output,
        })
    }
}

/// Takes the directory, stops what an earlier owner left running in it, and makes this
/// start's password.
async fn open_persistent(dir: &Path) -> Result<Data, Error> {
    std::fs::create_dir_all(dir).map_err(Error::io(format!("creating {}", dir.display())))?;
    let dir =
        std::fs::canonicalize(dir).map_err(Error::io(format!("resolving {}", dir.display())))?;
    let lock = DirLock::acquire(&dir.join(LOCK_FILE))?;
    if let Some(pid) = stop_stale_server(&dir, &dir.join(PID_FILE)).await? {
        tracing::warn!(pid, "stopped a redis-server left running by an earlier run");
    }
    Ok(Data::Persistent {
        dir,
        // Fresh per start: the previous server is gone, and nobody else needs it.
        password: uuid::Uuid::new_v4().simple().to_string(),
        _lock: lock,
    })
}

/// The command line, minus the port. A persistent server's password goes into a file
/// only the owner can read, not onto the command line, which every local user can see.
/// A Sentinel's configuration goes into that same file (or, when ephemeral, into a file of
/// its own), which comes first on the command line.
fn server_args(
    data: &Data,
    extra: &[String],
    sentinel_config: Option<&str>,
) -> Result<Vec<OsString>, Error> {
    let mut args = Vec::new();
    match data {
        Data::Ephemeral(dir) => {
            if let Some(config) = sentinel_config {
                let path = dir.path().join(SENTINEL_CONFIG_FILE);
                write_private(&path, config)?;
                args.push(path.into_os_string());
            }
            args.extend(base_args(dir.path()));
            args.extend(
                ["--save", "", "--appendonly", "no", "--protected-mode", "no"].map(OsString::from),
            );
        }
        Data::Persistent { dir, password, .. } => {
            let config = dir.join(CONFIG_FILE);
            let mut text = format!("requirepass {password}\n");
            if let Some(sentinel) = sentinel_config {
                text.push_str(sentinel);
                text.push('\n');
            }
            write_private(&config, &text)?;
            args.push(config.into_os_string());
            args.extend(base_args(dir));
            args.extend(
                [
                    "--save",
                    "",
                    "--appendonly",
                    "yes",
                    // Each write reaches the kernel before its reply is sent, so a crash
                    // of the process (redis-server or its owner) loses nothing; a crash of
                    // the machine can lose the last second.
                    "--appendfsync",
                    "everysec",
                ]
                .map(OsString::from),
            );
            args.push("--pidfile".into());
            args.push(dir.join(PID_FILE).into_os_string());
        }
    }
    args.extend(extra.iter().map(OsString::from));
    if sentinel_config.is_some() {
        args.push("--sentinel".into());
    }
    Ok(args)
}

fn write_private(path: &Path, contents: &str) -> Result<(), Error> {
    use std::io::Write;
    let context = || format!("writing {}", path.display());
    let _ = std::fs::remove_file(path);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(Error::io(context()))?;
    file.write_all(contents.as_bytes())
        .map_err(Error::io(context()))
}

/// A `redis-server` process owned by this process, on a private loopback port.
///
/// Two kinds:
/// - [`ephemeral`](Self::ephemeral): a temporary directory and no persistence; dropping
///   the value kills the process and deletes the directory. For tests and throwaway
///   sandboxes.
/// - [`persistent`](Self::persistent): a data directory kept across runs, with an
///   append-only file, a password, and one owner at a time. For a service's embedded mode.
///
/// The server's output is drained continuously (so the pipe never fills and blocks the
/// server) and the last lines are kept, see [`recent_log`](Self::recent_log).
///
/// ```no_run
/// # async fn demo() -> Result<(), private_redis::Error> {
/// let redis = private_redis::PrivateRedis::persistent("./data/redis").start().await?;
/// println!("orders are kept in {} and served at {}", redis.dir().display(), redis.url());
/// redis.stop().await?;
/// # Ok(())
/// # }
/// ```
pub struct PrivateRedis {
    port: u16,
    binary: Binary,
    args: Vec<OsString>,
    kill_on_drop: bool,
    parent_death_signal: Option<Signal>,
    log: LogBuffer,
    /// Atomic because `pause`/`resume` take `&self`, so a shared server can be paused
    /// while other tasks use it.
    paused: AtomicBool,
    /// The output line that says the process accepts connections (differs for Sentinel).
    ready_marker: &'static str,
    child: Option<Child>,
    drains: Vec<JoinHandle<()>>,
    // Last: the directory (and its lock) outlives the process handles.
    data: Data,
}

impl fmt::Debug for PrivateRedis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrivateRedis")
            .field("port", &self.port)
            .field("pid", &self.pid())
            .field("paused", &self.paused.load(Ordering::SeqCst))
            .field("dir", &self.dir())
            .field("persistent", &self.is_persistent())
            .finish_non_exhaustive()
    }
}

impl PrivateRedis {
    /// A throwaway server: a temporary directory, no persistence (`--save ""`,
    /// `--appendonly no`), no password. Killed, and its directory deleted, on drop.
    pub fn ephemeral() -> Builder {
        Builder {
            persistent_dir: None,
            extra_args: Vec::new(),
            parent_death_signal: None,
            sentinel_config: None,
        }
    }

    /// A server whose data lives in `dir` (created if missing) and survives restarts:
    /// an append-only file synced every second, a random password per start, an
    /// exclusive lock on the directory, and a pid file so a server left running by a
    /// crashed owner is found and stopped before a new one starts. It stops when this
    /// process dies (see [`Builder::die_with_parent`]), and gracefully (SIGTERM) on drop.
    pub fn persistent(dir: impl AsRef<Path>) -> Builder {
        Builder {
            persistent_dir: Some(dir.as_ref().to_owned()),
            extra_args: Vec::new(),
            parent_death_signal: Some(Signal::SIGTERM),
            sentinel_config: None,
        }
    }

    /// The TCP port the server listens on (stable across restarts).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The connection URL, `redis://127.0.0.1:{port}/`, with the password of a
    /// persistent server (`redis://:PASSWORD@…`).
    pub fn url(&self) -> String {
        match &self.data {
            Data::Persistent { password, .. } => {
                format!("redis://:{password}@127.0.0.1:{}/", self.port)
            }
            Data::Ephemeral(_) => format!("redis://127.0.0.1:{}/", self.port),
        }
    }

    /// The server's directory.
    pub fn dir(&self) -> &Path {
        match &self.data {
            Data::Persistent { dir, .. } => dir,
            Data::Ephemeral(dir) => dir.path(),
        }
    }

    /// Whether the data survives a restart.
    pub fn is_persistent(&self) -> bool {
        matches!(self.data, Data::Persistent { .. })
    }

    /// Process id of the running server; `None` after [`kill`](Self::kill).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// Freezes the server with SIGSTOP, simulating a stop-the-world pause or an
    /// unreachable node: connections stay open but nothing is answered.
    ///
    /// The kernel acts on a pending SIGSTOP before the process runs any more user code, so
    /// once this returns the server will not answer again until [`resume`](Self::resume).
    pub fn pause(&self) -> Result<(), Error> {
        self.signal(Signal::SIGSTOP)?;
        self.paused.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Continues a server frozen by [`pause`](Self::pause) (SIGCONT). Harmless on a server
    /// that is not paused.
    pub fn resume(&self) -> Result<(), Error> {
        self.signal(Signal::SIGCONT)?;
        self.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Kills the server with SIGKILL, simulating a crash, and waits until the process has
    /// exited. Does nothing if it is not running.
    pub async fn kill(&mut self) -> Result<(), Error> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        // SIGKILL also ends a stopped process, so a paused server needs no SIGCONT first.
        child
            .kill()
            .await
            .map_err(Error::io("killing redis-server"))?;
        self.paused.store(false, Ordering::SeqCst);
        self.finish_drains().await;
        Ok(())
    }

    /// Kills the server if it is running, then starts a new one on the same port, in the
    /// same directory, with the same arguments, and waits until it accepts connections.
    ///
    /// An ephemeral server comes back **empty**, like a master that crashed before
    /// persisting. A persistent one replays its append-only file. Existing connections
    /// are broken either way; open new ones.
    pub async fn restart(&mut self) -> Result<(), Error> {
        self.kill().await?;
        push_line(
            &self.log,
            format!(
                "[private-redis] restarting redis-server on port {}",
                self.port
            ),
        );
        let mut last_output = String::new();
        for attempt in 1..=RESTART_BIND_ATTEMPTS {
            match self.launch().await {
                Ok(()) => {
                    tracing::debug!(port = self.port, attempt, "redis-server restarted");
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
        Err(Error::PortUnavailable {
            port: self.port,
            attempts: RESTART_BIND_ATTEMPTS,
            output: last_output,
        })
    }

    /// Stops the server gracefully: SIGTERM, so a persistent server finishes its
    /// append-only file and removes its pid file; SIGKILL if it has not exited within
    /// 10 s.
    pub async fn stop(mut self) -> Result<(), Error> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        if self.paused.load(Ordering::SeqCst) {
            let _ = self.resume_child(&child);
        }
        if let Some(pid) = child.id() {
            let _ = send_signal(pid_of(pid), Signal::SIGTERM);
        }
        match tokio::time::timeout(STOP_GRACE, child.wait()).await {
            Ok(waited) => {
                waited.map_err(Error::io("waiting for redis-server to stop"))?;
            }
            Err(_) => {
                tracing::warn!(after = ?STOP_GRACE, "redis-server ignored SIGTERM; killing it");
                child
                    .kill()
                    .await
                    .map_err(Error::io("killing redis-server"))?;
            }
        }
        self.finish_drains().await;
        Ok(())
    }

    /// Whether the server process has exited (crashed, or was killed from outside) since it
    /// was started. `false` after [`kill`](Self::kill): nothing runs then by design.
    pub fn has_exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| !matches!(child.try_wait(), Ok(None)))
    }

    /// The last lines (up to 50) the server wrote to stdout and stderr, oldest first.
    /// Stderr lines are prefixed with `stderr: `.
    pub fn recent_log(&self) -> Vec<String> {
        lock_log(&self.log).iter().cloned().collect()
    }

    async fn launch(&mut self) -> Result<(), Error> {
        let launched = launch(Launch {
            binary: &self.binary,
            port: self.port,
            args: &self.args,
            log: &self.log,
            kill_on_drop: self.kill_on_drop,
            parent_death_signal: self.parent_death_signal,
            ready_marker: self.ready_marker,
        })
        .await?;
        self.child = Some(launched.child);
        self.drains = launched.drains;
        Ok(())
    }

    async fn finish_drains(&mut self) {
        // Let the drains read the last output so `recent_log` is complete.
        for drain in self.drains.drain(..) {
            finish_drain(drain).await;
        }
    }

    fn resume_child(&self, child: &Child) -> Result<(), Error> {
        let pid = child.id().ok_or(Error::NotRunning)?;
        signal(pid, Signal::SIGCONT)?;
        self.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    fn signal(&self, which: Signal) -> Result<(), Error> {
        signal(self.pid().ok_or(Error::NotRunning)?, which)
    }
}

fn pid_of(pid: u32) -> Pid {
    Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX))
}

fn signal(pid: u32, which: Signal) -> Result<(), Error> {
    send_signal(pid_of(pid), which).map_err(|source| Error::Signal {
        signal: which.as_str(),
        pid,
        source,
    })
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        // A stopped process cannot act on SIGTERM, and should a kill fail, no frozen
        // redis-server may be left holding its port.
        if self.paused.load(Ordering::SeqCst) {
            let _ = self.resume();
        }
        if let Some(child) = self.child.as_mut() {
            // Errors mean the process is already gone. Reaping is left to tokio; blocking
            // here could stall a runtime thread.
            if self.kill_on_drop {
                let _ = child.start_kill();
            } else if let Some(pid) = child.id() {
                // A persistent server finishes its append-only file on SIGTERM; the next
                // owner of the directory waits for it if it is still at it.
                let _ = send_signal(pid_of(pid), Signal::SIGTERM);
            }
        }
        for drain in &self.drains {
            drain.abort();
        }
    }
}
