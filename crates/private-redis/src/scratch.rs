//! Temporary directories that a killed owner does not leave behind for good.
//!
//! `tempfile` removes a directory when its owner drops it, which a SIGKILL never lets
//! happen: every killed test run or load run used to leave its directory (and a Redis
//! data directory) in /tmp. A [`ScratchDir`] holds a lock file inside itself for as long
//! as it lives; creating the next one with the same prefix removes every directory of
//! that prefix whose lock nobody holds, since its owner is gone.

use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::data_dir::DirLock;
use crate::error::Error;

/// The lock file inside a scratch directory, held by its owner.
const OWNER_LOCK: &str = ".owner.lock";

/// How old an unheld directory must be before it is swept: one just created has no lock
/// yet, or has not taken it yet.
const SWEEP_AFTER: Duration = Duration::from_secs(60);

/// A temporary directory, removed on drop, and by a later [`ScratchDir::new`] of the same
/// prefix if its owner was killed.
#[derive(Debug)]
pub struct ScratchDir {
    // The lock is released after the directory is removed: a sweeper never sees a
    // half-removed directory as free.
    dir: tempfile::TempDir,
    _owner: DirLock,
}

impl ScratchDir {
    /// Sweeps directories of `prefix` left by owners that are gone, then creates a new one
    /// in the system's temporary directory and holds it.
    pub fn new(prefix: &str) -> Result<ScratchDir, Error> {
        sweep(&std::env::temp_dir(), prefix);
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .map_err(Error::io("creating a temporary directory"))?;
        let owner = DirLock::acquire(&dir.path().join(OWNER_LOCK))?;
        Ok(ScratchDir { dir, _owner: owner })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

/// Removes the directories of `prefix` in `parent` that hold an owner lock nobody holds.
/// Best effort: anything unreadable is left alone.
fn sweep(parent: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let ours = entry.file_name().to_string_lossy().starts_with(prefix)
            && entry.file_type().is_ok_and(|kind| kind.is_dir());
        let lock = path.join(OWNER_LOCK);
        let old_enough = std::fs::metadata(&lock)
            .and_then(|meta| meta.modified())
            .ok()
            .and_then(|modified| SystemTime::now().duration_since(modified).ok())
            .is_some_and(|age| age >= SWEEP_AFTER);
        if !(ours && old_enough) {
            continue;
        }
        if let Ok(_gone_owner) = DirLock::acquire(&lock) {
            if std::fs::remove_dir_all(&path).is_ok() {
                tracing::info!(dir = %path.display(), "removed a temporary directory left by a killed run");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_whose_owner_is_gone_is_swept_and_a_held_one_is_kept() {
        let parent = tempfile::tempdir().expect("parent");
        let abandoned = parent.path().join("scratch-test-abandoned");
        std::fs::create_dir(&abandoned).expect("dir");
        std::fs::write(abandoned.join(OWNER_LOCK), "").expect("lock file");
        let held = parent.path().join("scratch-test-held");
        std::fs::create_dir(&held).expect("dir");
        let _owner = DirLock::acquire(&held.join(OWNER_LOCK)).expect("hold");
        let fresh = parent.path().join("scratch-test-fresh");
        std::fs::create_dir(&fresh).expect("dir");
        let other = parent.path().join("unrelated");
        std::fs::create_dir(&other).expect("dir");
        std::fs::write(other.join(OWNER_LOCK), "").expect("lock file");
        let old = SystemTime::now() - Duration::from_secs(3600);
        for dir in [&abandoned, &held, &other] {
            let file = std::fs::File::options()
                .write(true)
                .open(dir.join(OWNER_LOCK))
                .expect("open");
            file.set_modified(old).expect("age it");
        }
        std::fs::write(fresh.join(OWNER_LOCK), "").expect("lock file");

        sweep(parent.path(), "scratch-test-");
        assert!(!abandoned.exists(), "an abandoned directory is swept");
        assert!(held.exists(), "a held directory is kept");
        assert!(fresh.exists(), "a directory created a moment ago is kept");
        assert!(other.exists(), "another prefix is not ours");
    }
}
