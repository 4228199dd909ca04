//! `distlock status`, `list` and `force-unlock`: what an operator asks about a lock.
//!
//! A key counts as a lock only when it has a lock's shape: a hash whose fields are
//! holders (`<client id>:<n>`, a writer's `…:write`, a read-write lock's `mode`) with
//! whole-number hold counts. Another application's hash is never shown as a lock, and
//! never deleted by `force-unlock`.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Duration;

use serde::Serialize;

use crate::args::{Fence, ForceUnlock, List, Status};
use crate::exit::{self, Failure};
use crate::out::{print, shown};
use crate::shape::{base, helper, kind_of, snapshot, Snapshot};

/// `distlock status NAME`.
pub async fn status(client: &distlock::Client, args: &Status) -> Result<u8, Failure> {
    let snapshot = snapshot(client, &args.name).await?;
    if args.json {
        print(&to_json(&snapshot)?);
        return Ok(0);
    }
    let mut lines = vec![
        format!("name:        {}", shown(&snapshot.name)),
        format!("held:        {}", if snapshot.held { "yes" } else { "no" }),
        format!(
            "kind:        {}{}{}",
            snapshot.kind,
            snapshot
                .mode
                .as_deref()
                .map(|mode| format!(" ({})", shown(mode)))
                .unwrap_or_default(),
            match snapshot.created_by_distlock {
                Some(true) => " (created by distlock run -n)",
                Some(false) if snapshot.kind == "number" => {
                    " (not created by distlock: run -n takes it only with --adopt-semaphore)"
                }
                Some(false) => " (not created by distlock)",
                None => "",
            }
        ),
    ];
    for holder in &snapshot.holders {
        lines.push(match holder.lease_remaining_ms {
            Some(lease) => format!(
                "holder:      {} ({} left)",
                shown(&holder.owner),
                seconds(lease)
            ),
            None => format!(
                "holder:      {} (holds {})",
                shown(&holder.owner),
                holder.holds
            ),
        });
        if let Some(info) = &holder.info {
            lines.push(format!(
                "  host:      {}, pid {}{}",
                shown(&info.host),
                info.pid,
                info.command_pid
                    .map(|pid| format!(" (command pid {pid})"))
                    .unwrap_or_default()
            ));
            if !info.command.is_empty() {
                lines.push(format!("  command:   {}", shown(&info.command)));
            }
            lines.push(format!(
                "  since:     {} ({} ago)",
                crate::holder::utc(info.started_at_ms),
                seconds(crate::holder::unix_ms().saturating_sub(info.started_at_ms))
            ));
        }
    }
    if let Some(lease) = snapshot.lease_remaining_ms {
        lines.push(format!("lease left:  {}", seconds(lease)));
    }
    if let Some(queued) = snapshot.queued {
        lines.push(format!("queued:      {queued}"));
    }
    if let Some(free) = snapshot.free_permits {
        lines.push(format!("free:        {free} permits"));
    }
    if let Some(token) = snapshot.last_fencing_token {
        lines.push(format!("last token:  {token}"));
    }
    for line in lines {
        if !print(&line) {
            break;
        }
    }
    Ok(0)
}

/// `distlock fence NAME [--at-least N]`: the lock's fencing counter, raised when asked.
pub async fn fence(client: &distlock::Client, args: &Fence) -> Result<u8, Failure> {
    let shown = shown(&args.name);
    let kind = kind_of(client, &args.name).await?;
    if !matches!(
        kind.as_str(),
        "none" | "lock" | "fair lock" | "read-write lock"
    ) {
        return Err(Failure::new(
            exit::USAGE,
            format!("{shown} is a {kind}, not a lock: it has no fencing tokens"),
        ));
    }
    let lock = client.lock(args.name.clone())?;
    let before = lock.last_fencing_token().await?;
    let counter = match args.at_least {
        Some(floor) => lock.advance_fencing_counter(floor).await?,
        None => before,
    };
    if args.json {
        #[derive(Serialize)]
        struct Counter<'a> {
            name: &'a str,
            /// The highest token handed out, or the counter raised to: the next holder's
            /// token is larger.
            counter: u64,
            raised: bool,
        }
        let json = serde_json::to_string(&Counter {
            name: &args.name,
            counter,
            raised: counter > before,
        })
        .map_err(|err| Failure::new(exit::INTERNAL, err.to_string()))?;
        print(&json);
        return Ok(0);
    }
    let line = match args.at_least {
        Some(_) if counter > before => format!(
            "{shown}: fencing counter raised from {before} to {counter}; the next holder's token is above it"
        ),
        Some(floor) => format!(
            "{shown}: fencing counter at {counter}, already at least {floor}; not changed"
        ),
        None => format!("{shown}: fencing counter at {counter}; the next holder's token is above it"),
    };
    print(&line);
    Ok(0)
}

/// `distlock list [PATTERN]`.
pub async fn list(client: &distlock::Client, args: &List) -> Result<u8, Failure> {
    if client.store() != distlock::StoreKind::Redis {
        return Err(Failure::new(
            exit::USAGE,
            "list is available on Redis only so far; ask about one lock with `distlock status NAME`",
        ));
    }
    if client.is_cluster() {
        return Err(Failure::new(
            exit::USAGE,
            "list does not scan a Redis Cluster yet (its locks are spread over the masters); \
             use status NAME, or redis-cli --cluster call HOST:PORT SCAN 0 TYPE hash",
        ));
    }
    let mut found = Vec::new();
    // Locks are hashes named as given; permit semaphores are known by their set of
    // permits: `{name}:timeout`, or `name:timeout` for a name with a hash tag of its own.
    let scans = [
        ("hash", args.pattern.clone()),
        ("zset", format!("{{{}}}:timeout", args.pattern)),
        ("zset", format!("{}:timeout", args.pattern)),
    ];
    let mut seen = std::collections::HashSet::new();
    for (kind, pattern) in scans {
        for key in scan(client, &pattern, kind).await? {
            let name = match kind {
                "zset" => match semaphore_of(&key) {
                    Some(name) => name,
                    None => continue,
                },
                _ => key,
            };
            if !seen.insert(name.clone()) {
                continue;
            }
            // A key the library cannot take as a lock name (another app's) is skipped.
            let Ok(snapshot) = snapshot(client, &name).await else {
                continue;
            };
            if snapshot.held {
                found.push(snapshot);
            }
        }
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    if args.json {
        for snapshot in &found {
            if !print(&to_json(snapshot)?) {
                break;
            }
        }
        return Ok(0);
    }
    if !print(&format!(
        "{:<32} {:<16} {:>10} {:>6}  {:<16} {:>8}  {:<23}  {:<38}  COMMAND",
        "NAME", "KIND", "LEASE LEFT", "HOLDS", "HOST", "PID", "STARTED", "HOLDER"
    )) {
        return Ok(0);
    }
    for snapshot in &found {
        let kind = match &snapshot.mode {
            Some(mode) => format!("{} ({})", snapshot.kind, shown(mode)),
            None => snapshot.kind.clone(),
        };
        for holder in &snapshot.holders {
            let lease = holder
                .lease_remaining_ms
                .or(snapshot.lease_remaining_ms)
                .map(seconds)
                .unwrap_or_else(|| "-".into());
            let (host, pid, started, command) = match &holder.info {
                Some(info) => (
                    shown(&info.host),
                    info.pid.to_string(),
                    crate::holder::utc(info.started_at_ms),
                    shown(&info.command),
                ),
                None => ("-".into(), "-".into(), "-".into(), String::new()),
            };
            let line = format!(
                "{:<32} {:<16} {:>10} {:>6}  {:<16} {:>8}  {:<23}  {:<38}  {}",
                shown(&snapshot.name),
                kind,
                lease,
                holder.holds,
                host,
                pid,
                started,
                shown(&holder.owner),
                command
            );
            if !print(&line) {
                return Ok(0);
            }
        }
    }
    Ok(0)
}

/// The semaphore whose set of permits is `key`: `{name}:timeout` for a name without
/// braces, `name:timeout` for one with a hash tag.
fn semaphore_of(key: &str) -> Option<String> {
    let inner = key.strip_suffix(":timeout")?;
    match inner
        .strip_prefix('{')
        .and_then(|rest| rest.strip_suffix('}'))
    {
        Some(name) if !name.contains(['{', '}']) => Some(name.to_owned()),
        _ if inner.contains('{') => Some(inner.to_owned()),
        _ => None,
    }
}

/// The keys of `kind` matching `pattern`, by SCAN. Keys that are not UTF-8 are skipped:
/// distlock never names a lock so.
async fn scan(
    client: &distlock::Client,
    pattern: &str,
    kind: &str,
) -> Result<Vec<String>, Failure> {
    let mut connection = client.connection();
    let mut cursor: u64 = 0;
    let mut keys = Vec::new();
    loop {
        let (next, batch): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .arg("TYPE")
            .arg(kind)
            .query_async(&mut connection)
            .await?;
        keys.extend(
            batch
                .into_iter()
                .filter_map(|key| String::from_utf8(key).ok()),
        );
        if next == 0 {
            return Ok(keys);
        }
        cursor = next;
    }
}

/// `distlock force-unlock NAME`.
pub async fn force_unlock(client: &distlock::Client, args: &ForceUnlock) -> Result<u8, Failure> {
    let name = shown(&args.name);
    let snapshot = snapshot(client, &args.name).await?;
    match snapshot.kind.as_str() {
        "semaphore" => {
            return Err(Failure::new(
                exit::USAGE,
                format!(
                    "{name} is a semaphore: force-unlock deletes locks only; its permits come back as their leases end"
                ),
            ))
        }
        "not a lock" => {
            return Err(Failure::new(
                exit::USAGE,
                format!("{name} is not a lock (another application's key?); not deleted"),
            ))
        }
        _ => {}
    }
    let Some(confirmed) = snapshot.holders.first() else {
        print(&format!("{name} is not locked"));
        return Ok(0);
    };
    if !args.yes {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return Err(Failure::new(
                exit::USAGE,
                "force-unlock asks before it deletes a lock, and stdin is not a terminal: pass --yes",
            ));
        }
        let holders: Vec<String> = snapshot
            .holders
            .iter()
            .map(|holder| shown(&holder.owner))
            .collect();
        let mut stdout = std::io::stdout().lock();
        let _ = write!(
            stdout,
            "Delete {name} held by {}? Its holder's command is stopped. [y/N] ",
            holders.join(", ")
        );
        let _ = stdout.flush();
        drop(stdout);
        let mut answer = String::new();
        stdin
            .lock()
            .read_line(&mut answer)
            .map_err(|err| Failure::new(exit::INTERNAL, err.to_string()))?;
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            print("not deleted");
            return Ok(1);
        }
    }
    // Only the holder that was shown: a lock that passed to another holder meanwhile is
    // not that holder's to delete.
    let deleted = if snapshot.kind == "read-write lock" {
        force_unlock_rw(client, &args.name, &confirmed.owner).await?
    } else {
        let lock = client.lock(args.name.clone())?;
        lock.force_unlock_held_by(&confirmed.owner).await?
    };
    if deleted {
        print(&format!("{name} unlocked"));
        Ok(0)
    } else {
        print(&format!(
            "{name} is no longer held by {}; not deleted (look again with status)",
            shown(&confirmed.owner)
        ));
        Ok(1)
    }
}

/// Deletes the read-write lock `name` while `owner` (a field of its hash) holds it, with
/// its readers' hold keys, and wakes its waiters on the read-write lock's channel (see
/// scripts/rwlock_force_unlock.lua). The library has a force-unlock for the lease lock
/// only, whose release goes to the lease lock's channel, where a waiter for the
/// read-write lock does not listen.
async fn force_unlock_rw(
    client: &distlock::Client,
    name: &str,
    owner: &str,
) -> Result<bool, Failure> {
    static UNLOCK: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
        redis::Script::new(include_str!("scripts/rwlock_force_unlock.lua"))
    });
    let lock = client.rw_lock(name.to_owned())?;
    let mut connection = client.connection();
    let deleted: i64 = UNLOCK
        .key(lock.key())
        .key(helper(name, "redisson_rwlock"))
        .arg(owner)
        .arg(if client.is_cluster() {
            "spublish"
        } else {
            "publish"
        })
        .arg(base(name))
        .invoke_async(&mut connection)
        .await?;
    Ok(deleted == 1)
}

fn seconds(ms: u64) -> String {
    format!("{:.1}s", Duration::from_millis(ms).as_secs_f64())
}

fn to_json(snapshot: &Snapshot) -> Result<String, Failure> {
    serde_json::to_string(snapshot).map_err(|err| Failure::new(exit::INTERNAL, err.to_string()))
}
