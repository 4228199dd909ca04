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
/// number and its unit, `500ms`, `10s`, `2m` or `1h`, where the number may have a
/// decimal fraction (`1.5s`, `0.25h`), or several such terms from the largest unit down,
/// as Go writes durations (`1m30s`, `1h2m3.5s`). The result is whole milliseconds: a
/// finer value (`1.0005s`) is refused rather than rounded. Every duration flag takes
/// this one syntax; a bare number is refused, since it could mean either milliseconds or
/// seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let expected = "expected a number and a unit, or several from the largest unit down: \
                    500ms, 10s, 1.5s, 2m, 1m30s or 1h";
    if text.is_empty() {
        return Err(format!("{text:?}: {expected}"));
    }
    let mut rest = text;
    let mut total: u128 = 0;
    // The unit of the previous term: each next term's must be smaller.
    let mut previous: Option<u128> = None;
    while !rest.is_empty() {
        let whole_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        let (whole, after) = rest.split_at(whole_len);
        let (fraction, after) = match after.strip_prefix('.') {
            Some(after) => {
                let len = after.bytes().take_while(u8::is_ascii_digit).count();
                if len == 0 {
                    return Err(format!(
                        "{text:?}: a decimal point needs digits after it; {expected}"
                    ));
                }
                after.split_at(len)
            }
            None => ("", after),
        };
        if whole.is_empty() && fraction.is_empty() {
            return Err(format!("{text:?}: {expected}"));
        }
        let unit_len = after
            .bytes()
            .take_while(|byte| !byte.is_ascii_digit() && *byte != b'.')
            .count();
        let (unit, after) = after.split_at(unit_len);
        let millis_per_unit: u128 = match unit {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "" => return Err(format!("{text:?} has no unit: {expected}")),
            _ => return Err(format!("{text:?}: unknown unit {unit:?}; {expected}")),
        };
        if previous.is_some_and(|previous| millis_per_unit >= previous) {
            return Err(format!(
                "{text:?}: give each unit once, from the largest down; {expected}"
            ));
        }
        previous = Some(millis_per_unit);
        let too_long = || format!("{text:?} is too long");
        // Digits beyond these cannot make a whole millisecond of any unit, or fit.
        if whole.len() > 20 || fraction.len() > 12 {
            return Err(too_long());
        }
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().map_err(|_| too_long())?
        };
        let mut term = whole.checked_mul(millis_per_unit).ok_or_else(too_long)?;
        if !fraction.is_empty() {
            let scale = 10u128.pow(fraction.len() as u32);
            let numerator = fraction.parse::<u128>().map_err(|_| too_long())? * millis_per_unit;
            if !numerator.is_multiple_of(scale) {
                return Err(format!(
                    "{text:?} is finer than a millisecond, distlock's resolution"
                ));
            }
            term += numerator / scale;
        }
        total = total.checked_add(term).ok_or_else(too_long)?;
        rest = after;
    }
    u64::try_from(total)
        .map(Duration::from_millis)
        .map_err(|_| format!("{text:?} is too long"))
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
            "-1s",
            "10 sec",
            "10S",
            "99999999999999999999h",
            "1.s",
            ".s",
            "1.0005s",
            "30s1m",
            "1m1m",
            "1m 30s",
            "1.5",
            "1m30",
        ] {
            let refused = parse_duration(bad).expect_err(bad);
            assert!(refused.contains(bad.trim()) || bad.is_empty(), "{refused}");
        }
        assert!(parse_duration("10").expect_err("bare").contains("no unit"));
        assert!(parse_duration("1.0005s")
            .expect_err("fine")
            .contains("millisecond"));
    }

    #[test]
    fn decimal_and_compound_durations_read_as_go_and_flock_write_them() {
        let ms = Duration::from_millis;
        for (text, duration) in [
            ("1.5s", ms(1_500)),
            ("0.5s", ms(500)),
            (".5s", ms(500)),
            ("1m30s", ms(90_000)),
            ("1h2m3.5s", ms(3_723_500)),
            ("1.5h", ms(5_400_000)),
            ("2m500ms", ms(120_500)),
            ("0.001s", ms(1)),
            ("2.0ms", ms(2)),
        ] {
            assert_eq!(parse_duration(text), Ok(duration), "{text}");
        }
        // What format_duration writes is read back unchanged.
        for duration in [ms(1), ms(1_500), ms(90_000), ms(3_723_500)] {
            assert_eq!(parse_duration(&format_duration(duration)), Ok(duration));
        }
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
