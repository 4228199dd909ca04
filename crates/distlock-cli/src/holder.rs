//! Who holds a lock: each holder's host, pid, command and start time, for `status` and
//! `list`. Kept beside the lock in a hash of its own, `distlock_holders:{NAME}` (field:
//! the holder's owner id, value: JSON), never in the lock's hash, which Redisson reads and
//! writes. The hash expires a second after the longest lease of its holders (each holder
//! extends it as its lease is confirmed), and a holder removes its field as it lets go;
//! `status` shows a field only for an owner that holds now, so a dead holder's leftover
//! says nothing.
//!
//! The record is information, not a lock: a user whose ACL does not cover the key runs
//! its command all the same, without one (`--verbose` says so).

use std::collections::HashMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How much longer than the holder's lease the record lives.
const SLACK: Duration = Duration::from_secs(1);

/// The longest command line kept.
const MOST_COMMAND_CHARS: usize = 1000;

/// One holder's record.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Info {
    /// The host distlock runs on.
    pub host: String,
    /// distlock's own pid (signal it to stop the command: SIGTERM is passed on).
    pub pid: u32,
    /// The command's pid (its process group's), absent for `distlock hold`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command_pid: Option<u32>,
    /// The command line, as a shell would read it (empty for `distlock hold`).
    pub command: String,
    /// When the command started, milliseconds since the Unix epoch.
    pub started_at_ms: u64,
}

impl Info {
    /// This process's record for `command` (none for `hold`), started now.
    pub fn now(command: Option<&[std::ffi::OsString]>, command_pid: Option<u32>) -> Info {
        let host = nix::unistd::gethostname()
            .ok()
            .and_then(|host| host.into_string().ok())
            .unwrap_or_default();
        let command = command.map(shell_line).unwrap_or_default();
        Info {
            host,
            pid: std::process::id(),
            command_pid,
            command,
            started_at_ms: unix_ms(),
        }
    }
}

/// The holders' hash of lock `name`, in the lock's cluster slot (as its running mark).
pub fn key(name: &str) -> String {
    if name.contains('{') {
        format!("{name}:distlock_holders")
    } else {
        format!("distlock_holders:{{{name}}}")
    }
}

/// One holder's record in the hash, while it holds.
pub struct Record {
    connection: distlock::Connection,
    key: String,
    owner: String,
    written: bool,
    /// Records are kept on Redis only so far; on another store nothing is written, and
    /// `status` shows the holder's owner id alone.
    kept: bool,
}

impl Record {
    pub fn new(client: &distlock::Client, name: &str, owner: &str) -> Record {
        Record {
            connection: client.connection(),
            key: key(name),
            owner: owner.to_owned(),
            written: false,
            kept: client.store() == distlock::StoreKind::Redis,
        }
    }

    /// Writes the record, kept at least `lease_left` (plus a second).
    pub async fn write(&mut self, info: &Info, lease_left: Duration) {
        if !self.kept {
            return;
        }
        static WRITE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
            redis::Script::new(include_str!("scripts/holder_write.lua"))
        });
        let Ok(json) = serde_json::to_string(info) else {
            return;
        };
        let written = WRITE
            .key(&self.key)
            .arg(&self.owner)
            .arg(json)
            .arg(millis(lease_left + SLACK))
            .invoke_async::<i64>(&mut self.connection)
            .await;
        match written {
            Ok(_) => self.written = true,
            Err(err) => crate::out::verbose(|| {
                format!(
                    "could not record who holds the lock in {} ({}); status will not show it",
                    crate::out::shown(&self.key),
                    crate::exit::Failure::from(err).message
                )
            }),
        }
    }

    /// Keeps the record at least `lease_left` (plus a second) longer.
    pub async fn keep(&mut self, lease_left: Duration) {
        if !self.written {
            return;
        }
        static KEEP: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
            redis::Script::new(include_str!("scripts/holder_write.lua"))
        });
        let _ = KEEP
            .key(&self.key)
            .arg(&self.owner)
            .arg("")
            .arg(millis(lease_left + SLACK))
            .invoke_async::<i64>(&mut self.connection)
            .await;
    }

    /// Removes the record.
    pub async fn clear(&mut self) {
        if !std::mem::take(&mut self.written) {
            return;
        }
        let _ = redis::cmd("HDEL")
            .arg(&self.key)
            .arg(&self.owner)
            .query_async::<i64>(&mut self.connection)
            .await;
    }
}

/// The records of lock `name`'s holders, by owner. A record that does not parse (written
/// by something else) is left out; a refused read gives none.
pub async fn read(client: &distlock::Client, name: &str) -> HashMap<String, Info> {
    if client.store() != distlock::StoreKind::Redis {
        return HashMap::new();
    }
    let mut connection = client.connection();
    let fields: HashMap<String, String> = redis::cmd("HGETALL")
        .arg(key(name))
        .query_async(&mut connection)
        .await
        .unwrap_or_default();
    fields
        .into_iter()
        .filter_map(|(owner, json)| Some((owner, serde_json::from_str(&json).ok()?)))
        .collect()
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |now| u64::try_from(now.as_millis()).unwrap_or(u64::MAX))
}

/// A command line as a shell reads it: arguments with characters a shell treats
/// specially are single-quoted. Bytes that are not UTF-8 are shown as U+FFFD.
fn shell_line(command: &[std::ffi::OsString]) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./=:,@%+".contains(c);
    let mut line = command
        .iter()
        .map(|arg| {
            let arg = arg.to_string_lossy();
            if !arg.is_empty() && arg.chars().all(plain) {
                arg.into_owned()
            } else {
                format!("'{}'", arg.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    if line.chars().count() > MOST_COMMAND_CHARS {
        line = line.chars().take(MOST_COMMAND_CHARS).collect::<String>() + "…";
    }
    line
}

/// `ms` since the Unix epoch as a UTC time, `2026-11-27 19:40:33 UTC`.
pub fn utc(ms: u64) -> String {
    let seconds = ms / 1000;
    let (days, of_day) = (seconds / 86_400, seconds % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = i64::try_from(days).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02} UTC",
        of_day / 3600,
        of_day % 3600 / 60,
        of_day % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_and_command_lines_are_shown_as_people_read_them() {
        assert_eq!(utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(utc(1_795_808_433_000), "2026-11-27 19:40:33 UTC");
        assert_eq!(utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
        let line = shell_line(&["sh".into(), "-c".into(), "echo 'hi' > x".into()]);
        assert_eq!(line, r"sh -c 'echo '\''hi'\'' > x'");
        assert_eq!(shell_line(&["a".into(), "".into()]), "a ''");
    }

    #[test]
    fn a_records_key_shares_its_locks_slot() {
        assert_eq!(key("jobs"), "distlock_holders:{jobs}");
        assert_eq!(key("a{b}c"), "a{b}c:distlock_holders");
    }
}
