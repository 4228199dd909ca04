//! What makes a data directory safe to reuse: one owner at a time (an exclusive lock), and
//! no second server on the same files (a server left by an earlier owner is stopped first).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::fcntl::{Flock, FlockArg};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::error::Error;

/// An exclusive lock on a file, held until dropped, with the holder's pid written inside
/// so a refused process can say who holds it.
///
/// The lock is `flock(2)`: the kernel releases it when the holder exits for any reason,
/// kill -9 included, so a crash never leaves a directory locked.
#[derive(Debug)]
pub struct DirLock {
    _file: Flock<File>,
    path: PathBuf,
}

impl DirLock {
    /// Takes the lock on `path`, creating the file if needed, or fails at once with
    /// [`Error::InUse`] when another process holds it.
    pub fn acquire(path: &Path) -> Result<DirLock, Error> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(Error::io(format!(
                "opening the lock file {}",
                path.display()
            )))?;
        let mut file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(locked) => locked,
            Err((mut file, Errno::EWOULDBLOCK)) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                return Err(Error::InUse {
                    path: path.to_owned(),
                    holder: holder.trim().parse().ok(),
                });
            }
            Err((_, errno)) => {
                return Err(Error::Io {
                    context: format!("locking {}", path.display()),
                    source: errno.into(),
                })
            }
        };
        let record = |file: &mut File| -> std::io::Result<()> {
            file.set_len(0)?;
            file.rewind()?;
            writeln!(file, "{}", std::process::id())?;
            file.flush()
        };
        record(&mut file).map_err(Error::io(format!("writing {}", path.display())))?;
        Ok(DirLock {
            _file: file,
            path: path.to_owned(),
        })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// How long a server left by an earlier run gets to finish writing its append-only file
/// after SIGTERM, and then to die after SIGKILL.
const STALE_TERM_GRACE: Duration = Duration::from_secs(10);
const STALE_KILL_GRACE: Duration = Duration::from_secs(2);
/// There is no event for the exit of a process that is not our child, so it is polled.
const STALE_POLL: Duration = Duration::from_millis(10);

/// Stops the redis-server recorded in `pid_file` if it still runs in `dir`, and returns
/// its pid. A pid file whose process is gone, or is now some other program, is removed.
///
/// Only called with the directory's [`DirLock`] held, so the server found is an orphan of
/// an owner that died (its parent-death signal may already have it shutting down).
pub(crate) async fn stop_stale_server(dir: &Path, pid_file: &Path) -> Result<Option<u32>, Error> {
    let Ok(text) = std::fs::read_to_string(pid_file) else {
        return Ok(None);
    };
    let pid = text.trim().parse::<u32>().ok();
    let Some(pid) = pid.filter(|pid| runs_redis_in(*pid, dir)) else {
        let _ = std::fs::remove_file(pid_file);
        return Ok(None);
    };
    tracing::warn!(pid, dir = %dir.display(), "stopping a redis-server left by an earlier run");
    let target = Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX));
    // A stopped server (SIGSTOP) could not act on SIGTERM until continued.
    let _ = kill(target, Signal::SIGCONT);
    // SIGTERM lets it finish its append-only file; SIGKILL is for one that hangs.
    for (signal, grace) in [
        (Signal::SIGTERM, STALE_TERM_GRACE),
        (Signal::SIGKILL, STALE_KILL_GRACE),
    ] {
        let _ = kill(target, signal);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if !is_alive(pid) {
                let _ = std::fs::remove_file(pid_file);
                return Ok(Some(pid));
            }
            tokio::time::sleep(STALE_POLL).await;
        }
    }
    Err(Error::StaleServer {
        pid,
        dir: dir.to_owned(),
        waited: STALE_TERM_GRACE + STALE_KILL_GRACE,
    })
}

/// Whether `pid` is a redis-server whose working directory is `dir` (redis-server changes
/// into its `--dir`), so a recycled pid of another program is never signalled.
fn runs_redis_in(pid: u32, dir: &Path) -> bool {
    let proc = PathBuf::from(format!("/proc/{pid}"));
    let cwd = std::fs::read_link(proc.join("cwd")).ok();
    let wanted = std::fs::canonicalize(dir).ok();
    let comm = std::fs::read_to_string(proc.join("comm")).unwrap_or_default();
    cwd.is_some() && cwd == wanted && comm.starts_with("redis-server") && is_alive(pid)
}

/// Whether `pid` exists and is not a zombie waiting to be reaped.
fn is_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses and may contain
        // spaces.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_file_is_refused_and_names_the_holder() -> Result<(), Error> {
        let dir = tempfile::tempdir().map_err(Error::io("temp dir"))?;
        let path = dir.path().join("LOCK");
        let held = DirLock::acquire(&path)?;
        match DirLock::acquire(&path) {
            Err(Error::InUse { holder, .. }) => assert_eq!(holder, Some(std::process::id())),
            other => panic!("expected InUse, got {other:?}"),
        }
        drop(held);
        DirLock::acquire(&path)?;
        Ok(())
    }

    #[tokio::test]
    async fn a_pid_file_of_another_program_is_removed_without_a_signal() -> Result<(), Error> {
        let dir = tempfile::tempdir().map_err(Error::io("temp dir"))?;
        let pid_file = dir.path().join("redis-server.pid");
        // Our own pid: alive, but not a redis-server in that directory.
        std::fs::write(&pid_file, std::process::id().to_string()).map_err(Error::io("writing"))?;
        assert_eq!(stop_stale_server(dir.path(), &pid_file).await?, None);
        assert!(!pid_file.exists());
        Ok(())
    }
}
