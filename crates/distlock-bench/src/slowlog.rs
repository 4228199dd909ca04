//! Where the server's time goes, per command: a run with Redis's SLOWLOG logging every
//! command (`slowlog-log-slower-than 0`), grouped by what was called. A script call is
//! told apart by its number of keys and arguments (each of distlock's scripts has its
//! own), so the breakdown shows each script's calls and time per hold.
//!
//! Logging every command costs the server time of its own, so a profiled run is never
//! one of the timed runs: its figures say where the time goes, not how much there is.

use std::collections::BTreeMap;

use redis::aio::MultiplexedConnection;

use crate::scenarios::BenchResult;

/// Room for every command of a profiled run (about 20 per hold, for a few thousand holds).
const ENTRIES: u64 = 200_000;

/// One kind of call: its command, and for a script its key and argument counts.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct CallKind {
    pub command: String,
    pub keys: usize,
    pub args: usize,
}

impl CallKind {
    /// `evalsha 6k+7a`, or the command alone.
    pub fn label(&self) -> String {
        if self.command == "evalsha" || self.command == "eval" {
            format!("{} {}k+{}a", self.command, self.keys, self.args)
        } else {
            self.command.clone()
        }
    }
}

/// Calls of one kind in a profiled run.
#[derive(Debug, Default, Clone, Copy)]
pub struct Calls {
    pub count: u64,
    pub micros: u64,
}

/// Starts logging every command, from an empty log.
pub async fn start(connection: &mut MultiplexedConnection) -> BenchResult<()> {
    redis::pipe()
        .cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-max-len")
        .arg(ENTRIES)
        .ignore()
        .cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(0)
        .ignore()
        .cmd("SLOWLOG")
        .arg("RESET")
        .ignore()
        .query_async::<()>(connection)
        .await?;
    Ok(())
}

/// Stops logging, and reads what was logged since [`start`], grouped by kind of call
/// (the profiler's own CONFIG and SLOWLOG calls left out).
pub async fn stop(
    connection: &mut MultiplexedConnection,
) -> BenchResult<BTreeMap<CallKind, Calls>> {
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("slowlog-log-slower-than")
        .arg(10_000)
        .query_async(connection)
        .await?;
    let entries: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(-1)
        .query_async(connection)
        .await?;
    let _: () = redis::cmd("SLOWLOG")
        .arg("RESET")
        .query_async(connection)
        .await?;
    let mut calls: BTreeMap<CallKind, Calls> = BTreeMap::new();
    for entry in &entries {
        let Some((micros, kind)) = read_entry(entry) else {
            continue;
        };
        if ["config", "slowlog"].contains(&kind.command.as_str()) {
            continue;
        }
        let slot = calls.entry(kind).or_default();
        slot.count += 1;
        slot.micros += micros;
    }
    Ok(calls)
}

/// An entry is `[id, timestamp, micros, [command, args...], client, name]`.
fn read_entry(entry: &redis::Value) -> Option<(u64, CallKind)> {
    let redis::Value::Array(fields) = entry else {
        return None;
    };
    let micros = match fields.get(2)? {
        redis::Value::Int(micros) => u64::try_from(*micros).ok()?,
        _ => return None,
    };
    let redis::Value::Array(words) = fields.get(3)? else {
        return None;
    };
    let text = |value: &redis::Value| match value {
        redis::Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
        redis::Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    };
    let command = text(words.first()?)?.to_ascii_lowercase();
    let (keys, args) = if command == "evalsha" || command == "eval" {
        let keys: usize = text(words.get(2)?)?.parse().ok()?;
        // Past the command, the script and the key count. (SLOWLOG cuts a call at 32
        // words; distlock's scripts take at most 15.)
        let words_after = words.len().saturating_sub(3);
        (keys, words_after.saturating_sub(keys))
    } else {
        (0, 0)
    };
    Some((
        micros,
        CallKind {
            command,
            keys,
            args,
        },
    ))
}
