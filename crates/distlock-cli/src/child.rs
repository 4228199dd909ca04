//! The command distlock runs: its own process group, the terminal when it has one, the
//! signals it is sent, and how it is stopped.

use std::os::fd::AsFd;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use nix::sys::signal::{killpg, signal as set_handler, SigHandler, Signal};
use nix::unistd::{getpgrp, tcgetpgrp, tcsetpgrp, Pid};
use tokio::signal::unix::{signal, SignalKind};
use tokio::time::Instant;

use crate::exit::{self, Failure};

/// How often a stop looks whether the command's process group is empty yet.
const GROUP_POLL: Duration = Duration::from_millis(10);

/// A running command, leader of its own process group; or no command at all (`distlock
/// hold`), which "runs" until it is sent a signal that would end a command.
pub struct Child {
    /// `None` for no command.
    process: Option<tokio::process::Child>,
    group: Pid,
    /// No command: whether a signal has ended it.
    ended: std::cell::Cell<bool>,
    /// The terminal was handed to the command's group (stdin is the terminal and
    /// distlock had it): it is taken back when the command ends.
    has_terminal: bool,
}

impl Child {
    /// Starts `command` with `env` added, in a process group of its own, with stdin,
    /// stdout and stderr passed through. When distlock runs in the foreground of a
    /// terminal, the command's group gets the terminal (it reads it, and Ctrl-C and
    /// Ctrl-Z reach it, as under a shell). It gets SIGKILL if distlock dies (Linux), so a
    /// `kill -9` of distlock never leaves it running without its lock.
    pub fn spawn(command: &[std::ffi::OsString], env: &[(&str, String)]) -> Result<Child, Failure> {
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
            .and_then(|id| i32::try_from(id).ok())
            .ok_or_else(|| Failure::new(exit::INTERNAL, "the command ended before it started"))?;
        let group = Pid::from_raw(id);
        let has_terminal = hand_terminal_to(group);
        Ok(Child {
            process: Some(process),
            group,
            ended: std::cell::Cell::new(false),
            has_terminal,
        })
    }

    /// The command's pid (its process group's id); `None` for no command.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().and_then(tokio::process::Child::id)
    }

    /// The command's process group, as `--verbose` names it.
    pub fn describe(&self) -> String {
        format!("process group {}", self.group)
    }

    /// No command: held until SIGINT, SIGTERM, SIGHUP (or a stop), which end it with
    /// status 0.
    pub fn idle() -> Child {
        Child {
            process: None,
            group: Pid::from_raw(0),
            ended: std::cell::Cell::new(false),
            has_terminal: false,
        }
    }

    /// Sends `signal` to the command's process group, then SIGCONT, so that a command
    /// stopped (Ctrl-Z, or reading a terminal it does not own) handles it, as a shell's
    /// `kill` does.
    pub fn signal(&self, signal: Signal) {
        if self.process.is_none() {
            if matches!(
                signal,
                Signal::SIGINT | Signal::SIGTERM | Signal::SIGHUP | Signal::SIGKILL
            ) {
                self.ended.set(true);
            }
            return;
        }
        // ESRCH: the group is gone already, which is what a stop wants.
        let _ = killpg(self.group, signal);
        if signal != Signal::SIGKILL && signal != Signal::SIGCONT {
            let _ = killpg(self.group, Signal::SIGCONT);
        }
    }

    /// Waits for the command to exit.
    pub async fn wait(&mut self) -> Result<ExitStatus, Failure> {
        let Some(process) = &mut self.process else {
            if !self.ended.get() {
                std::future::pending::<()>().await;
            }
            return Ok(std::os::unix::process::ExitStatusExt::from_raw(0));
        };
        let status = process.wait().await.map_err(|err| {
            Failure::new(
                exit::INTERNAL,
                format!("cannot wait for the command: {err}"),
            )
        });
        self.take_terminal_back();
        status
    }

    /// Sends SIGTERM to the command's process group: a stop begins.
    pub fn terminate(&self) {
        self.signal(Signal::SIGTERM);
    }

    /// Ends a stop begun with [`Child::terminate`]: SIGKILL at `kill_at` to whatever of
    /// the group is left, even when the command itself exited on SIGTERM (a process it
    /// started may ignore it). Returns once the group is gone (or a second after SIGKILL,
    /// for processes the kernel has not reaped yet).
    pub async fn stop(&mut self, kill_at: Instant) -> Result<ExitStatus, Failure> {
        let exited = tokio::select! {
            status = self.wait() => Some(status?),
            () = tokio::time::sleep_until(kill_at) => None,
        };
        while self.group_alive() && Instant::now() < kill_at {
            tokio::time::sleep(GROUP_POLL).await;
        }
        self.signal(Signal::SIGKILL);
        let status = match exited {
            Some(status) => status,
            None => self.wait().await?,
        };
        let killed_at = Instant::now();
        while self.group_alive() && killed_at.elapsed() < Duration::from_secs(1) {
            tokio::time::sleep(GROUP_POLL).await;
        }
        Ok(status)
    }

    /// Whether any live process of the command's group is left. Zombies do not count: a
    /// process that died after its parent is reaped by init, and in a container init may
    /// never do it.
    pub fn group_alive(&self) -> bool {
        if self.process.is_none() {
            return !self.ended.get();
        }
        if killpg(self.group, None).is_err() {
            return false;
        }
        live_members(self.group).unwrap_or(true)
    }

    fn take_terminal_back(&mut self) {
        if std::mem::take(&mut self.has_terminal) {
            // From a background group this would stop distlock with SIGTTOU.
            // SAFETY: only the disposition of SIGTTOU changes, for the one call.
            unsafe {
                let previous = set_handler(Signal::SIGTTOU, SigHandler::SigIgn);
                let _ = tcsetpgrp(std::io::stdin().as_fd(), getpgrp());
                if let Ok(previous) = previous {
                    let _ = set_handler(Signal::SIGTTOU, previous);
                }
            }
        }
    }
}

/// Whether `group` has a member that is not a zombie, from /proc (Linux); `None` where
/// /proc cannot be read.
fn live_members(group: Pid) -> Option<bool> {
    let group = group.as_raw().to_string();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // "pid (comm) state ppid pgrp …": comm may hold spaces and parentheses.
        let Some((_, fields)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = fields.split_whitespace();
        let (Some(state), Some(_ppid), Some(pgrp)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if pgrp == group && state != "Z" && state != "X" {
            return Some(true);
        }
    }
    Some(false)
}

/// Gives the terminal on stdin to `group` if distlock holds it now (it runs in the
/// foreground). Returns whether it did.
fn hand_terminal_to(group: Pid) -> bool {
    let stdin = std::io::stdin();
    match tcgetpgrp(stdin.as_fd()) {
        Ok(foreground) if foreground == getpgrp() => tcsetpgrp(stdin.as_fd(), group).is_ok(),
        _ => false,
    }
}

/// The exit code that reports `status` as a shell would: the code, or 128 + the signal.
pub fn code_of(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => (code & 0xff) as u8,
        (None, Some(signal)) => u8::try_from(128 + signal).unwrap_or(u8::MAX),
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

/// The exit code for ending on `signal` before the command ran: as a shell reports it.
pub fn signal_code(signal: Signal) -> u8 {
    u8::try_from(128 + signal as i32).unwrap_or(u8::MAX)
}
