//! One server process of a consensus store (an etcd member, a ZooKeeper server): spawned
//! from a command line kept for restarts, its output drained into a short log for
//! diagnostics, and signals for the faults tests inject. Shared by
//! [`EtcdCluster`](crate::EtcdCluster) and [`ZkEnsemble`](crate::ZkEnsemble).

use std::collections::VecDeque;
use std::ffi::OsString;
use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufRead, AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::error::TestkitError;

/// Lines of output kept per process.
const LOG_CAPACITY: usize = 60;

type LogBuffer = Arc<Mutex<VecDeque<String>>>;

/// A server process that can be frozen, killed and started again with the same command
/// line. Killed (SIGKILL) when dropped.
#[derive(Debug)]
pub(crate) struct StoreProcess {
    /// Names the process in errors, e.g. `etcd member 2`.
    label: String,
    program: PathBuf,
    args: Vec<OsString>,
    child: Option<Child>,
    log: LogBuffer,
    /// Mirrors SIGSTOP/SIGCONT, so that waits skip a process that cannot answer.
    paused: AtomicBool,
}

impl StoreProcess {
    /// Spawns `program args`, with its stdout and stderr drained into the log.
    pub(crate) fn spawn(
        label: String,
        program: PathBuf,
        args: Vec<OsString>,
    ) -> Result<StoreProcess, TestkitError> {
        let mut process = StoreProcess {
            label,
            program,
            args,
            child: None,
            log: Arc::default(),
            paused: AtomicBool::new(false),
        };
        process.launch()?;
        Ok(process)
    }

    fn launch(&mut self) -> Result<(), TestkitError> {
        let mut child = Command::new(&self.program)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(TestkitError::io(format!(
                "starting {} ({})",
                self.label,
                self.program.display()
            )))?;
        if let Some(stdout) = child.stdout.take() {
            tokio::spawn(drain(BufReader::new(stdout), self.log.clone()));
        }
        if let Some(stderr) = child.stderr.take() {
            tokio::spawn(drain(BufReader::new(stderr), self.log.clone()));
        }
        self.child = Some(child);
        self.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// What names the process in errors.
    pub(crate) fn label(&self) -> &str {
        &self.label
    }

    /// The process id while it runs (frozen counts as running).
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }

    /// Running and not frozen: it can answer.
    pub(crate) fn is_live(&self) -> bool {
        self.pid().is_some() && !self.paused.load(Ordering::SeqCst)
    }

    /// The exit status if the process has ended by itself (say, its port was taken).
    pub(crate) fn exited(&mut self) -> Option<ExitStatus> {
        self.child.as_mut()?.try_wait().ok().flatten()
    }

    /// SIGSTOP: the process keeps its sockets but answers nothing.
    pub(crate) fn pause(&self) -> Result<(), TestkitError> {
        self.signal(Signal::SIGSTOP)?;
        self.paused.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// SIGCONT after [`pause`](Self::pause); harmless on a process that is not frozen.
    pub(crate) fn resume(&self) -> Result<(), TestkitError> {
        self.signal(Signal::SIGCONT)?;
        self.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    fn signal(&self, signal: Signal) -> Result<(), TestkitError> {
        let pid = self
            .pid()
            .ok_or_else(|| TestkitError::Topology(format!("{} is not running", self.label)))?;
        let pid = i32::try_from(pid)
            .map_err(|_| TestkitError::Topology(format!("pid {pid} out of range")))?;
        kill(Pid::from_raw(pid), signal).map_err(|err| TestkitError::Io {
            context: format!("sending {signal} to {}", self.label),
            source: err.into(),
        })
    }

    /// SIGKILL, then waits until the process has exited. Does nothing if it is not
    /// running.
    pub(crate) async fn kill(&mut self) -> Result<(), TestkitError> {
        if let Some(mut child) = self.child.take() {
            child
                .kill()
                .await
                .map_err(TestkitError::io(format!("killing {}", self.label)))?;
        }
        self.paused.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// Kills the process if it runs, then starts it again with the same command line.
    pub(crate) async fn restart(&mut self) -> Result<(), TestkitError> {
        self.kill().await?;
        push_line(&self.log, "--- restarted by the testkit ---".to_owned());
        self.launch()
    }

    /// The last lines of output, oldest first.
    pub(crate) fn recent_log(&self) -> Vec<String> {
        lock_log(&self.log).iter().cloned().collect()
    }

    /// The last lines of output as one text, for error messages.
    pub(crate) fn log_text(&self) -> String {
        self.recent_log().join("\n")
    }
}

/// `n` distinct free loopback ports. All are held at once while probing, so none is
/// handed out twice; another process can still take one before the server binds it,
/// which the callers handle by starting again on new ports.
pub(crate) fn pick_free_ports(n: usize) -> Result<Vec<u16>, TestkitError> {
    let listeners = (0..n)
        .map(|_| TcpListener::bind((Ipv4Addr::LOCALHOST, 0)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(TestkitError::io("probing for free loopback ports"))?;
    listeners
        .iter()
        .map(|listener| listener.local_addr().map(|addr| addr.port()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(TestkitError::io("reading the probed ports"))
}

/// Copies lines into the log until end of file: an unread pipe eventually fills and
/// blocks the server's logging, which would freeze it.
async fn drain<R: AsyncBufRead + Unpin>(mut reader: R, log: LogBuffer) {
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf);
                push_line(&log, line.trim_end_matches(['\n', '\r']).to_owned());
            }
        }
    }
}

fn push_line(log: &LogBuffer, line: String) {
    tracing::trace!(target: "distlock_testkit::store", "{line}");
    let mut log = lock_log(log);
    if log.len() == LOG_CAPACITY {
        log.pop_front();
    }
    log.push_back(line);
}

fn lock_log(log: &LogBuffer) -> MutexGuard<'_, VecDeque<String>> {
    // A panic can only interrupt a push or pop, which leaves the deque valid.
    log.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Finds `name` in the directories of `PATH`.
pub(crate) fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct() -> Result<(), TestkitError> {
        let mut ports = pick_free_ports(9)?;
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 9);
        Ok(())
    }

    #[test]
    fn log_keeps_only_the_newest_lines() {
        let log = LogBuffer::default();
        for n in 0..LOG_CAPACITY + 5 {
            push_line(&log, n.to_string());
        }
        let lines = lock_log(&log);
        assert_eq!(lines.len(), LOG_CAPACITY);
        assert_eq!(lines.front().map(String::as_str), Some("5"));
    }
}
