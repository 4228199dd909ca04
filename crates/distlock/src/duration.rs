//! Validation of user-supplied durations into the millisecond values Redis takes.

use std::time::Duration;

use crate::error::{Error, Result};

/// Redis keeps expiries as signed 64-bit milliseconds on an absolute clock, so a lease must
/// leave room for "now" to be added to it. One hundred years is far beyond any sane lease and
/// far below the overflow point.
const MAX_MILLIS: u128 = 100 * 365 * 24 * 60 * 60 * 1000;

/// Converts `value` to whole milliseconds for Redis, refusing zero, sub-millisecond
/// values (Redis would round them to "no expiry" or an immediate one) and overflow.
pub(crate) fn to_millis(what: &'static str, value: Duration) -> Result<u64> {
    let millis = value.as_millis();
    if value.is_zero() {
        return Err(Error::InvalidDuration {
            what,
            reason: "must be greater than zero".into(),
        });
    }
    if millis == 0 {
        return Err(Error::InvalidDuration {
            what,
            reason: format!("{value:?} is below Redis' one-millisecond resolution"),
        });
    }
    if millis > MAX_MILLIS {
        return Err(Error::InvalidDuration {
            what,
            reason: format!("{value:?} does not fit a Redis millisecond expiry"),
        });
    }
    // Cannot truncate: bounded by MAX_MILLIS above.
    Ok(millis as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_values() {
        assert_eq!(
            to_millis("lease", Duration::from_secs(30)).ok(),
            Some(30_000)
        );
        assert_eq!(to_millis("lease", Duration::from_millis(1)).ok(), Some(1));
    }

    #[test]
    fn refuses_zero_tiny_and_huge() {
        for bad in [Duration::ZERO, Duration::from_micros(999), Duration::MAX] {
            let err = to_millis("lease", bad).expect_err("must be refused");
            assert!(matches!(err, Error::InvalidDuration { what: "lease", .. }));
        }
    }
}
