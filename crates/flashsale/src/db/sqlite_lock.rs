//! Who holds a SQLite store's write lock. When a query fails with SQLITE_BUSY because
//! another process sits on the lock without answering (say one frozen with SIGSTOP in the
//! middle of a transaction), "database is locked" alone leaves an operator guessing; this
//! names the process. Linux only, from /proc/locks and /proc/PID, best effort: a holder
//! may exit while we look.

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nix::sys::stat::{major, minor};

/// The longest command line kept, in characters: enough to tell `flashsale serve` from a
/// `sqlite3` shell without flooding a log line.
const COMMAND_MAX: usize = 120;

/// A process holding a lock on a SQLite store's files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LockHolder {
    /// Its process id, as this process's pid namespace sees it.
    pub pid: i32,
    /// Its command line, arguments joined with spaces (empty if unreadable), truncated to
    /// about 120 characters.
    pub command: String,
    /// Its state letter from /proc/PID/stat ('T' stopped, 't' traced, 'S', 'R', 'D', ...),
    /// if readable.
    pub state: Option<char>,
}

impl LockHolder {
    /// Whether it is stopped (SIGSTOP, or stopped by a debugger): it will not release its
    /// lock until continued.
    pub fn is_stopped(&self) -> bool {
        matches!(self.state, Some('T' | 't'))
    }
}

/// The processes other than this one that hold a WRITE (exclusive) POSIX, OFD or flock
/// lock on `db` or on its `-wal` / `-shm` companions, ordered by pid; empty when there are
/// none or /proc/locks cannot be read. SQLite's writer locks byte 120 of the `-shm` file in
/// WAL mode, bytes of the database itself (around 0x40000000) in rollback-journal mode; any
/// write lock counts. Matching by device and inode finds locks taken through other paths.
pub fn write_lock_holders(db: &Path) -> Vec<LockHolder> {
    let files: Vec<(u64, u64, u64)> = ["", "-wal", "-shm"]
        .iter()
        .filter_map(|suffix| {
            let mut name = db.as_os_str().to_owned();
            name.push(suffix);
            // A missing companion is normal: no -wal/-shm in rollback-journal mode.
            let meta = std::fs::metadata(name).ok()?;
            Some((major(meta.dev()), minor(meta.dev()), meta.ino()))
        })
        .collect();
    // Unreadable (not Linux, /proc not mounted): no holders rather than an error, since
    // this only adds detail to an error being reported already.
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let own_pid = i32::try_from(std::process::id()).unwrap_or(-1);
    holders_in(&locks, &files, own_pid)
        .into_iter()
        .map(holder)
        .collect()
}

/// One line for an operator, naming the holder and how to free the lock.
pub fn describe(holder: &LockHolder) -> String {
    let pid = holder.pid;
    let who = if holder.command.is_empty() {
        format!("process {pid}")
    } else {
        format!("process {pid} ({})", holder.command)
    };
    // A stopped process that handles SIGTERM (as `flashsale serve` does, for a graceful
    // shutdown) keeps a plain `kill` pending until it is continued: only SIGKILL ends it.
    match holder.state {
        Some('T') => format!(
            "{who}, stopped (SIGSTOP): continue it with `kill -CONT {pid}` \
             or end it with `kill -KILL {pid}`"
        ),
        Some('t') => format!(
            "{who}, stopped by a debugger: detach the debugger or end it with `kill -KILL {pid}`"
        ),
        Some(_) => format!(
            "{who}, running: it holds the write lock; end it with `kill {pid}` if it does not answer"
        ),
        // /proc/PID/stat unreadable: it may have exited since /proc/locks was read.
        None => format!(
            "{who}: it held the write lock; end it with `kill {pid}` if it does not answer"
        ),
    }
}

/// The pids, sorted and deduplicated, that hold a write lock on one of `files` (device
/// major, device minor, inode) in `locks_text`, the contents of /proc/locks.
fn holders_in(locks_text: &str, files: &[(u64, u64, u64)], own_pid: i32) -> Vec<i32> {
    let pids: BTreeSet<i32> = locks_text
        .lines()
        .filter_map(|line| {
            // "1: POSIX  ADVISORY  WRITE 12345 08:01:123456 120 120", after the ordinal.
            let mut fields = line.split_whitespace().skip(1);
            let (class, _advisory, kind) = (fields.next()?, fields.next()?, fields.next()?);
            let pid: i32 = fields.next()?.parse().ok()?;
            let file = lock_file(fields.next()?)?;
            // A waiter's line has "->" for its class: it is blocked behind the lock, not
            // holding it. Leases and delegations are not locks SQLite takes. OFD locks
            // belong to no process (pid -1); pid 0 is an owner outside our pid namespace.
            let held = matches!(class, "POSIX" | "FLOCK" | "OFDLCK") && kind == "WRITE";
            (held && pid > 0 && pid != own_pid && files.contains(&file)).then_some(pid)
        })
        .collect();
    pids.into_iter().collect()
}

/// Parses /proc/locks' "MAJOR:MINOR:INODE" field: device numbers in hex, inode in decimal.
fn lock_file(field: &str) -> Option<(u64, u64, u64)> {
    let mut parts = field.split(':');
    let dev_major = u64::from_str_radix(parts.next()?, 16).ok()?;
    let dev_minor = u64::from_str_radix(parts.next()?, 16).ok()?;
    let inode = parts.next()?.parse().ok()?;
    parts
        .next()
        .is_none()
        .then_some((dev_major, dev_minor, inode))
}

/// What /proc says about `pid`; fields it cannot read stay empty.
fn holder(pid: i32) -> LockHolder {
    let command = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| command_line(&raw))
        .unwrap_or_default();
    let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat_state(&stat));
    LockHolder {
        pid,
        command,
        state,
    }
}

/// /proc/PID/cmdline's NUL-separated arguments, joined with spaces and truncated. Other
/// control characters (a `python3 -c` script's newlines) become spaces too, to keep the
/// operator's message on one line.
fn command_line(raw: &[u8]) -> String {
    let raw = raw.strip_suffix(&[0]).unwrap_or(raw);
    let joined: String = String::from_utf8_lossy(raw)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if joined.chars().count() <= COMMAND_MAX {
        return joined;
    }
    let mut cut: String = joined.chars().take(COMMAND_MAX - 1).collect();
    cut.push('…');
    cut
}

/// The state letter of /proc/PID/stat ("42 (comm) T 1 ..."). The command name may hold
/// spaces and parentheses itself, so the state is the first field after the last ')'.
fn stat_state(stat: &str) -> Option<char> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.trim_start().chars().next()
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::libc;
    use nix::sys::signal::{kill, Signal};
    use nix::sys::wait::waitpid;
    use nix::unistd::{fork, pause, pipe2, read, write, ForkResult, Pid};
    use std::time::{Duration, Instant};

    const SAMPLE: &str = "\
1: POSIX  ADVISORY  WRITE 300 08:01:123456 120 120
1: -> POSIX  ADVISORY  WRITE 777 08:01:123456 120 120
2: POSIX  ADVISORY  READ  400 08:01:123456 128 128
3: OFDLCK ADVISORY  WRITE -1 08:01:123456 0 EOF
4: FLOCK  ADVISORY  WRITE 200 fe:1a:99 0 EOF
5: POSIX  ADVISORY  WRITE 300 fe:1a:99 1073741824 1073741824
6: POSIX  ADVISORY  WRITE 500 08:01:999999 0 EOF
7: POSIX  ADVISORY  WRITE 42 08:01:123456 0 EOF
8: LEASE  ACTIVE    WRITE 600 08:01:123456 0 EOF
9: POSIX  ADVISORY  WRITE 0 08:01:123456 0 EOF
garbage
10: POSIX ADVISORY WRITE notapid 08:01:123456 0 EOF
11: POSIX ADVISORY WRITE 700 08:zz:123456 0 EOF

12: FLOCK  ADVISORY  WRITE 100 08:01:123456";

    #[test]
    fn parses_proc_locks() {
        let files = [(0x08, 0x01, 123456), (0xfe, 0x1a, 99)];
        // 300 is listed twice; 42 is our own pid; the rest are waiters, readers, OFD,
        // other files, leases, pid 0 or unparsable.
        assert_eq!(holders_in(SAMPLE, &files, 42), vec![100, 200, 300]);
        assert_eq!(holders_in(SAMPLE, &files[1..], 42), vec![200, 300]);
        assert!(holders_in(SAMPLE, &[], 42).is_empty());
        assert!(holders_in("", &files, 42).is_empty());
    }

    #[test]
    fn parses_proc_pid_files_and_describes() {
        assert_eq!(stat_state("42 (a) b) (c) T 1 2 3"), Some('T'));
        assert_eq!(stat_state("42 (sh) S 1"), Some('S'));
        assert_eq!(stat_state("no parenthesis"), None);
        assert_eq!(
            command_line(b"flashsale\0serve\0--listen\0:8080\0"),
            "flashsale serve --listen :8080"
        );
        assert_eq!(command_line(b"sh\0-c\0a\nb\0"), "sh -c a b");
        assert_eq!(command_line(b""), "");
        let long = command_line("é".repeat(300).as_bytes());
        assert_eq!(long.chars().count(), COMMAND_MAX);
        assert!(long.ends_with('…'));

        let mut holder = LockHolder {
            pid: 4242,
            command: "flashsale serve".into(),
            state: Some('T'),
        };
        assert!(holder.is_stopped());
        assert!(describe(&holder).starts_with("process 4242 (flashsale serve), stopped (SIGSTOP)"));
        assert!(describe(&holder).contains("`kill -CONT 4242`"));
        holder.state = Some('S');
        assert!(!holder.is_stopped());
        assert!(
            describe(&holder).contains("running: it holds the write lock; end it with `kill 4242`")
        );
        holder.command.clear();
        assert!(describe(&holder).starts_with("process 4242, running"));
    }

    /// SIGKILLs and reaps the forked child however the test ends.
    struct Reap(Pid);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = kill(self.0, Signal::SIGKILL);
            let _ = waitpid(self.0, None);
        }
    }

    /// A child holding SQLite's WAL write lock (byte 120 of the -shm file) is named,
    /// then seen stopped once it gets SIGSTOP. Our own lock on the database is not listed.
    #[test]
    fn names_a_forked_holder_and_sees_it_stopped() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("x.db");
        let db_file = std::fs::File::create(&db).expect("create x.db");
        let shm = std::fs::File::create(dir.path().join("x.db-shm")).expect("create x.db-shm");
        // Built before fork: a child of a multithreaded process may only make
        // async-signal-safe calls (fcntl, write, pause), not allocate.
        // SAFETY: flock is plain integers, for which all zeroes is valid.
        let mut lock: libc::flock = unsafe { std::mem::zeroed() };
        lock.l_type = libc::F_WRLCK as _;
        lock.l_whence = libc::SEEK_SET as _;
        lock.l_start = 120;
        lock.l_len = 1;
        let (ready_read, ready_write) = pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe");
        // SAFETY: the child only calls fcntl, write and pause, all async-signal-safe.
        let child = match unsafe { fork() }.expect("fork") {
            ForkResult::Child => {
                let taken = nix::fcntl::fcntl(&shm, nix::fcntl::FcntlArg::F_SETLK(&lock)).is_ok();
                let _ = write(&ready_write, if taken { b"y" } else { b"n" });
                loop {
                    pause();
                }
            }
            ForkResult::Parent { child } => Reap(child),
        };
        drop(ready_write);
        let mut byte = [0u8];
        assert_eq!(read(&ready_read, &mut byte).expect("read"), 1, "child died");
        assert_eq!(&byte, b"y", "child could not lock");

        // Our own lock, as a rollback-journal writer would take it, must not be listed.
        lock.l_start = 0x4000_0000;
        nix::fcntl::fcntl(&db_file, nix::fcntl::FcntlArg::F_SETLK(&lock)).expect("own lock");

        let pid = child.0.as_raw();
        let holders = write_lock_holders(&db);
        assert_eq!(holders.iter().map(|h| h.pid).collect::<Vec<_>>(), vec![pid]);
        assert!(!holders[0].is_stopped(), "{holders:?}");
        assert!(!holders[0].command.is_empty());

        kill(child.0, Signal::SIGSTOP).expect("SIGSTOP");
        let deadline = Instant::now() + Duration::from_secs(5);
        let stopped = loop {
            let holders = write_lock_holders(&db);
            if holders.first().is_some_and(LockHolder::is_stopped) || Instant::now() > deadline {
                break holders;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(stopped.len() == 1 && stopped[0].is_stopped(), "{stopped:?}");
        assert!(describe(&stopped[0]).contains(&format!("`kill -CONT {pid}`")));
    }
}
