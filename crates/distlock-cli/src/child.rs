//! The command distlock runs: its own process group, the signals it is sent, and how it
//! is stopped.

use std::process::{ExitStatus, Stdio};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio::time::Instant;

use crate::exit::{self, Failure};

/// A running command, leader of its own process group.
pub struct Child {
    process: tokio::process::Child,
    group: Pid,
}

impl Child {
    /// Starts `command` with `env` added, in a process group of its own, with stdin,
    /// stdout and stderr passed through. It gets SIGKILL if distlock dies (Linux), so a
    /// `kill -9` of distlock never leaves it running without its lock.
    pub fn spawn(command: &[String], env: &[(&str, String)]) -> Result<Child, Failure> {
        let (program, args) = command
            .split_first()
            .ok_or_else(|| Failure::new(exit::USAGE, "no command after --"))?;
        let mut builder = tokio::process::Command::new(program);
        builder
            .args(args)
            .envs(env.iter().map(|(key, value)| (key, value)))
            .stdin(Stdio::inherit())
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .process_group(0);
        #[cfg(target_os = "linux")]
        // SAFETY: runs in the forked child before exec; prctl is async-signal-safe.
        unsafe {
            builder.pre_exec(|| {
                nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(std::io::Error::from)
            });
        }
        let process = builder.spawn().map_err(|err| {
            let code = match err.kind() {
                std::io::ErrorKind::NotFound => exit::NOT_FOUND,
                std::io::ErrorKind::PermissionDenied => exit::CANNOT_EXECUTE,
                _ => exit::INTERNAL,
            };
            Failure::new(code, format!("cannot run {program:?}: {err}"))
        })?;
        let id = process
            .id()
            .ok_or_else(|| Failure::new(exit::INTERNAL, "the command ended before it started"))?;
        let group = Pid::from_raw(
            i32::try_from(id)
                .map_err(|_| Failure::new(exit::INTERNAL, "process id out of range"))?,
        );
        Ok(Child { process, group })
    }

    /// Sends `signal` to the command's process group.
    pub fn signal(&self, signal: Signal) {
        // ESRCH: the group is gone already, which is what a stop wants.
        let _ = killpg(self.group, signal);
    }

    /// Waits for the command to exit.
    pub async fn wait(&mut self) -> Result<ExitStatus, Failure> {
        self.process.wait().await.map_err(|err| {
            Failure::new(
                exit::INTERNAL,
                format!("cannot wait for the command: {err}"),
            )
        })
    }

    /// Stops the command: SIGTERM to its group, then SIGKILL at `kill_at` if it has not
    /// exited.
    pub async fn stop(&mut self, kill_at: Instant) -> Result<ExitStatus, Failure> {
        self.signal(Signal::SIGTERM);
        tokio::select! {
            status = self.process.wait() => {
                return status.map_err(|err| Failure::new(exit::INTERNAL, format!("cannot wait for the command: {err}")));
            }
            () = tokio::time::sleep_until(kill_at) => {}
        }
        self.signal(Signal::SIGKILL);
        self.wait().await
    }
}

/// The exit code that reports `status` as a shell would: the code, or 128 + the signal.
pub fn code_of(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => (code & 0xff) as u8,
        (None, Some(signal)) => (128 + signal).clamp(0, 255) as u8,
        (None, None) => exit::INTERNAL,
    }
}

/// The signals distlock passes on to the command: SIGINT, SIGTERM and SIGHUP.
pub struct Forwarded {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl Forwarded {
    /// Takes these signals over from their default action (which would end distlock and
    /// leave the command without a lock).
    pub fn install() -> Result<Forwarded, Failure> {
        let install = |kind: SignalKind| {
            signal(kind).map_err(|err| {
                Failure::new(exit::INTERNAL, format!("cannot handle signals: {err}"))
            })
        };
        Ok(Forwarded {
            interrupt: install(SignalKind::interrupt())?,
            terminate: install(SignalKind::terminate())?,
            hangup: install(SignalKind::hangup())?,
        })
    }

    /// The next signal received.
    pub async fn next(&mut self) -> Signal {
        tokio::select! {
            _ = self.interrupt.recv() => Signal::SIGINT,
            _ = self.terminate.recv() => Signal::SIGTERM,
            _ = self.hangup.recv() => Signal::SIGHUP,
        }
    }
}
