//! Validation of user-supplied durations into the millisecond values Redis takes, and the
//! one syntax distlock's tools read durations in.

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

/// Parses a duration as distlock's tools take it (the `distlock` command, flashsale): a
/// whole number and its unit, `500ms`, `10s`, `2m` or `1h`. Every duration flag takes this
/// one syntax; a bare number is refused, since it could
/// mean either milliseconds or seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = text.split_at(digits);
    let expected = "expected a whole number and a unit: 500ms, 10s, 2m or 1h";
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?}: {expected}"))?;
    let millis_per_unit = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "" => return Err(format!("{text:?} has no unit: {expected}")),
        _ => return Err(format!("{text:?}: unknown unit {unit:?}; {expected}")),
    };
    number
        .checked_mul(millis_per_unit)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{text:?} is too long"))
}

/// Writes a duration the way [`parse_duration`] reads it, in the largest unit that keeps
/// it whole.
pub fn format_duration(duration: Duration) -> String {
    let ms = duration.as_millis();
    match ms {
        0 => "0ms".to_owned(),
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1_000 == 0 => format!("{}s", ms / 1_000),
        ms => format!("{ms}ms"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_duration_flag_reads_one_syntax_and_refuses_a_bare_number() {
        let ms = Duration::from_millis;
        for (text, duration) in [
            ("500ms", ms(500)),
            ("10s", ms(10_000)),
            ("2m", ms(120_000)),
            ("1h", ms(3_600_000)),
            ("0ms", ms(0)),
        ] {
            assert_eq!(parse_duration(text), Ok(duration), "{text}");
            assert_eq!(format_duration(duration), text);
        }
        for bad in [
            "10",
            "",
            "s",
            "1.5s",
            "-1s",
            "10 sec",
            "10S",
            "99999999999999999999h",
        ] {
            let refused = parse_duration(bad).expect_err(bad);
            assert!(refused.contains(bad.trim()) || bad.is_empty(), "{refused}");
        }
        assert!(parse_duration("10").expect_err("bare").contains("no unit"));
    }

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
