//! A clock that is comparable across processes.

use std::sync::OnceLock;
use std::time::Instant;

use nix::time::{clock_gettime, ClockId};

const NANOS_PER_SEC: u64 = 1_000_000_000;

/// Nanoseconds on the machine-wide monotonic clock.
///
/// On Linux `CLOCK_MONOTONIC` is a single clock shared by every process of
/// the machine, so intervals recorded by different processes (for example
/// several lock-contending test binaries) can be merged and compared
/// directly. Unlike wall-clock time it never jumps backwards when NTP or an
/// operator adjusts the system time.
///
/// `clock_gettime(CLOCK_MONOTONIC)` cannot fail on Linux. Should it fail on
/// some other platform, this falls back to nanoseconds since the first call
/// in *this* process, which is still monotonic but no longer comparable
/// across processes.
pub fn monotonic_ns() -> u64 {
    match clock_gettime(ClockId::CLOCK_MONOTONIC) {
        Ok(ts) => timespec_ns(ts.tv_sec(), ts.tv_nsec()),
        Err(_) => process_local_ns(),
    }
}

fn timespec_ns(sec: i64, nsec: i64) -> u64 {
    // Monotonic time is never negative; saturating keeps this total anyway.
    let sec = u64::try_from(sec).unwrap_or(0);
    let nsec = u64::try_from(nsec).unwrap_or(0);
    sec.saturating_mul(NANOS_PER_SEC).saturating_add(nsec)
}

fn process_local_ns() -> u64 {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    let elapsed = ORIGIN.get_or_init(Instant::now).elapsed().as_nanos();
    u64::try_from(elapsed).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_goes_backwards() {
        let mut previous = monotonic_ns();
        for _ in 0..1_000 {
            let now = monotonic_ns();
            assert!(now >= previous, "{now} < {previous}");
            previous = now;
        }
    }

    #[test]
    fn advances_with_real_time() {
        let before = monotonic_ns();
        std::thread::sleep(std::time::Duration::from_millis(5));
        let elapsed = monotonic_ns() - before;
        assert!(elapsed >= 5_000_000, "only {elapsed} ns elapsed");
    }

    #[test]
    fn timespec_conversion_saturates() {
        assert_eq!(timespec_ns(1, 5), NANOS_PER_SEC + 5);
        assert_eq!(timespec_ns(-1, 5), 5);
        assert_eq!(timespec_ns(i64::MAX, 0), u64::MAX);
    }
}
