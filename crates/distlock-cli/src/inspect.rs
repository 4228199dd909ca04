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

/// A lock, or a permit semaphore, as the server has it now.
#[derive(Debug, Serialize)]
struct Snapshot {
    name: String,
    held: bool,
    /// `lock`, `fair lock`, `read-write lock`, `semaphore`, `number` (a count that may be
    /// a semaphore, which distlock did not create), `none`, or `not a lock`.
    kind: String,
    /// For a semaphore or a number: whether `distlock run -n` created it (its mark
    /// `{NAME}:distlock_semaphore` is beside it).
    #[serde(skip_serializing_if = "Option::is_none")]
    created_by_distlock: Option<bool>,
    /// `read` or `write`, for a read-write lock.
    #[serde(skip_serializing_if = "Option::is_none")]
    mode: Option<String>,
    holders: Vec<Holder>,
    /// Milliseconds; absent when free or without expiry.
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_remaining_ms: Option<u64>,
    /// Waiters queued (a fair lock).
    #[serde(skip_serializing_if = "Option::is_none")]
    queued: Option<u64>,
    /// Free permits (a semaphore).
    #[serde(skip_serializing_if = "Option::is_none")]
    free_permits: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    last_fencing_token: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Holder {
    /// The holder's id: a lock's owner field, or a permit's id.
    owner: String,
    holds: u64,
    /// A permit's own lease, milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_remaining_ms: Option<u64>,
    /// Who it is: host, pid, command, start (`host`, `pid`, `command_pid`, `command`,
    /// `started_at_ms`), when its distlock recorded it (src/holder.rs).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    info: Option<crate::holder::Info>,
    /// `started_at_ms` as a UTC time.
    #[serde(skip_serializing_if = "Option::is_none")]
    started_at: Option<String>,
}

impl Snapshot {
    fn free(name: &str, kind: &str) -> Snapshot {
        Snapshot {
            name: name.to_owned(),
            held: false,
            kind: kind.into(),
            created_by_distlock: None,
            mode: None,
            holders: Vec::new(),
            lease_remaining_ms: None,
            queued: None,
            free_permits: None,
            last_fencing_token: None,
        }
    }
}

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

/// `<prefix>:{<name>}`, a helper key or channel before the name (`<prefix>:<name>` when
/// the name has a hash tag of its own), as the library's layout names them.
pub fn helper(name: &str, prefix: &str) -> String {
    if name.contains('{') {
        format!("{prefix}:{name}")
    } else {
        format!("{prefix}:{{{name}}}")
    }
}

/// `{<name>}`, or the name when it has a hash tag of its own: what the read-write lock's
/// hold keys start with (`<base>:<owner>:rwlock_timeout:<n>`).
fn base(name: &str) -> String {
    if name.contains('{') {
        name.to_owned()
    } else {
        format!("{{{name}}}")
    }
}

/// What `name` is now, as `status` says it: `none`, `lock`, `fair lock`, `read-write
/// lock`, `semaphore`, `number`, or `not a lock`.
///
/// Reads the name's key only (TYPE, and a hash's fields or a string's value), so that
/// `run` can ask it with the ACL `run` needs.
pub async fn kind_of(client: &distlock::Client, name: &str) -> Result<String, Failure> {
    let lock = client.lock(name.to_owned())?;
    let mut connection = client.connection();
    let (kind, pttl): (String, i64) = redis::pipe()
        .cmd("TYPE")
        .arg(lock.key())
        .pttl(lock.key())
        .query_async(&mut connection)
        .await?;
    Ok(match kind.as_str() {
        "none" => "none".into(),
        "hash" => hash_shape(client, &lock, name, pttl).await?.kind,
        "string" => {
            let value: Vec<u8> = redis::cmd("GET")
                .arg(lock.key())
                .query_async(&mut connection)
                .await?;
            let number = std::str::from_utf8(&value)
                .ok()
                .and_then(|text| text.parse::<i64>().ok());
            match number {
                Some(_) => "number".into(),
                None => "not a lock".into(),
            }
        }
        _ => "not a lock".into(),
    })
}

/// Reads what `name` holds, with each holder's record of who it is.
async fn snapshot(client: &distlock::Client, name: &str) -> Result<Snapshot, Failure> {
    let mut snapshot = holding(client, name).await?;
    if snapshot.held {
        let mut records = crate::holder::read(client, name).await;
        for holder in &mut snapshot.holders {
            holder.info = records.remove(&holder.owner);
            holder.started_at = holder
                .info
                .as_ref()
                .map(|info| crate::holder::utc(info.started_at_ms));
        }
    }
    Ok(snapshot)
}

/// Reads what `name` holds.
async fn holding(client: &distlock::Client, name: &str) -> Result<Snapshot, Failure> {
    let lock = client.lock(name.to_owned())?;
    let mut connection = client.connection();
    let key = lock.key().to_owned();
    let (kind, pttl): (String, i64) = redis::pipe()
        .cmd("TYPE")
        .arg(&key)
        .pttl(&key)
        .query_async(&mut connection)
        .await?;
    match kind.as_str() {
        "hash" => lock_snapshot(client, &lock, name, pttl).await,
        "none" | "string" => {
            let mut snapshot = permit_snapshot(client, name, &kind).await?;
            if snapshot.kind == "none" {
                // A free lock still has its counter: the next holder's token is above it.
                snapshot.last_fencing_token = Some(lock.last_fencing_token().await?);
            }
            Ok(snapshot)
        }
        _ => Ok(Snapshot::free(name, "not a lock")),
    }
}

/// Hashes bigger than this are not locks (a read-write lock has one field per reader
/// process and the mode): they are not read whole.
const MOST_LOCK_FIELDS: i64 = 1024;

async fn lock_snapshot(
    client: &distlock::Client,
    lock: &distlock::Lock,
    name: &str,
    pttl: i64,
) -> Result<Snapshot, Failure> {
    let mut snapshot = hash_shape(client, lock, name, pttl).await?;
    if snapshot.kind == "not a lock" {
        return Ok(snapshot);
    }
    let queued = client.fair_lock(name.to_owned())?.queued().await?;
    if snapshot.kind == "lock" && queued > 0 {
        snapshot.kind = "fair lock".into();
    }
    snapshot.queued = (queued > 0).then(|| u64::try_from(queued).unwrap_or(u64::MAX));
    snapshot.last_fencing_token = Some(lock.last_fencing_token().await?);
    Ok(snapshot)
}

/// A hash at the lock's name: a lock (`lock`, or `read-write lock`) with its holders,
/// mode and lease when it has a lock's shape, else `not a lock`.
async fn hash_shape(
    client: &distlock::Client,
    lock: &distlock::Lock,
    name: &str,
    pttl: i64,
) -> Result<Snapshot, Failure> {
    let mut connection = client.connection();
    let fields: i64 = redis::cmd("HLEN")
        .arg(lock.key())
        .query_async(&mut connection)
        .await?;
    if fields > MOST_LOCK_FIELDS {
        return Ok(Snapshot::free(name, "not a lock"));
    }
    let entries: Vec<(Vec<u8>, Vec<u8>)> = redis::cmd("HGETALL")
        .arg(lock.key())
        .query_async(&mut connection)
        .await?;
    let mut snapshot = Snapshot::free(name, "lock");
    for (field, value) in entries {
        let (Ok(field), Ok(value)) = (String::from_utf8(field), String::from_utf8(value)) else {
            return Ok(Snapshot::free(name, "not a lock"));
        };
        if field == "mode" {
            snapshot.mode = Some(value);
            continue;
        }
        match value.parse::<u64>() {
            Ok(holds) if is_owner(&field) => snapshot.holders.push(Holder {
                owner: field,
                holds,
                lease_remaining_ms: None,
                info: None,
                started_at: None,
            }),
            _ => return Ok(Snapshot::free(name, "not a lock")),
        }
    }
    // A lock always has a lease, and a plain one (no mode) has one holder.
    if pttl < 0 || (snapshot.mode.is_none() && snapshot.holders.len() > 1) {
        return Ok(Snapshot::free(name, "not a lock"));
    }
    if snapshot.mode.is_some() {
        snapshot.kind = "read-write lock".into();
        live_readers(client, name, &mut snapshot.holders).await?;
    }
    snapshot.held = !snapshot.holders.is_empty();
    snapshot.lease_remaining_ms = u64::try_from(pttl).ok();
    Ok(snapshot)
}

/// Leaves out of a read-write lock's `holders` the readers none of whose holds is alive:
/// a reader's field stays in the hash after its holder died (kill -9) while another
/// reader keeps the hash alive, but each of its holds has a key of its own,
/// `{NAME}:<owner>:rwlock_timeout:<n>`, that runs out with that hold's lease
/// (docs/layout.md). The writer's field (`…:write`) lives as long as the hash.
async fn live_readers(
    client: &distlock::Client,
    name: &str,
    holders: &mut Vec<Holder>,
) -> Result<(), Failure> {
    let readers: Vec<usize> = (0..holders.len())
        .filter(|&i| !holders[i].owner.ends_with(":write"))
        .collect();
    if readers.is_empty() {
        return Ok(());
    }
    let base = base(name);
    let mut pipe = redis::pipe();
    for &i in &readers {
        let holder = &holders[i];
        let mut exists = redis::cmd("EXISTS");
        for n in 1..=holder.holds.clamp(1, MOST_HOLD_KEYS) {
            exists.arg(format!("{base}:{}:rwlock_timeout:{n}", holder.owner));
        }
        pipe.add_command(exists);
    }
    let mut connection = client.connection();
    let alive: Vec<u64> = pipe.query_async(&mut connection).await?;
    let dead: std::collections::HashSet<usize> = readers
        .iter()
        .zip(alive)
        .filter(|&(_, alive)| alive == 0)
        .map(|(&i, _)| i)
        .collect();
    let mut i = 0;
    holders.retain(|_| {
        i += 1;
        !dead.contains(&(i - 1))
    });
    Ok(())
}

/// The most hold keys of one reader looked at (its holds are re-entries by one process:
/// a reader with more is alive if one of the first ones is).
const MOST_HOLD_KEYS: u64 = 1024;

/// A permit semaphore (`distlock run -n`): its free count at the name, and its permits,
/// each with its lease, in `{name}:timeout`.
async fn permit_snapshot(
    client: &distlock::Client,
    name: &str,
    kind: &str,
) -> Result<Snapshot, Failure> {
    let semaphore = client.permit_semaphore(name.to_owned())?;
    let mut connection = client.connection();
    let permits_key = crate::mark::tagged(name, "timeout");
    /// The server's time, the permits with their deadlines, and the mark's value.
    type Read = ((u64, u64), Vec<(String, f64)>, Option<Vec<u8>>);
    let ((seconds, micros), permits, mark): Read = redis::pipe()
        .cmd("TIME")
        .cmd("ZRANGE")
        .arg(&permits_key)
        .arg(0)
        .arg(-1)
        .arg("WITHSCORES")
        .get(crate::held::semaphore_mark(name))
        .query_async(&mut connection)
        .await?;
    // The mark of `q` and of `{q}` is one key: it holds the name it was made for.
    let created = crate::held::marks(mark.as_deref(), name);
    if kind == "none" && permits.is_empty() {
        return Ok(Snapshot::free(name, "none"));
    }
    let free = match kind {
        "string" => match semaphore.available_permits().await {
            Ok(free) => Some(free),
            // Not a count: another application's string.
            Err(_) => return Ok(Snapshot::free(name, "not a lock")),
        },
        _ => None,
    };
    let now_ms = seconds * 1000 + micros / 1000;
    // A count with no permits taken and no mark of distlock's may be any application's
    // number: it is a semaphore only if the operator says so.
    let kind = if created || !permits.is_empty() {
        "semaphore"
    } else {
        "number"
    };
    let mut snapshot = Snapshot::free(name, kind);
    snapshot.created_by_distlock = Some(created);
    for (id, deadline) in permits {
        // Deadlines are whole milliseconds on the server's clock.
        let deadline = deadline as u64;
        if deadline > now_ms {
            snapshot.holders.push(Holder {
                owner: id,
                holds: 1,
                lease_remaining_ms: Some(deadline - now_ms),
                info: None,
                started_at: None,
            });
        }
    }
    snapshot.held = !snapshot.holders.is_empty();
    snapshot.free_permits = free;
    Ok(snapshot)
}

/// A lock holder's field: `<client id>:<n>`, or a writer's `<client id>:<n>:write`, where
/// the client id is a UUID (distlock's and Redisson's both are).
fn is_owner(field: &str) -> bool {
    let field = field.strip_suffix(":write").unwrap_or(field);
    let Some((client, number)) = field.rsplit_once(':') else {
        return false;
    };
    !number.is_empty() && number.bytes().all(|byte| byte.is_ascii_digit()) && is_uuid(client)
}

/// `8-4-4-4-12` hexadecimal digits.
fn is_uuid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    groups.iter().map(|group| group.len()).eq([8, 4, 4, 4, 12])
        && groups
            .iter()
            .all(|group| group.bytes().all(|byte| byte.is_ascii_hexdigit()))
}

fn seconds(ms: u64) -> String {
    format!("{:.1}s", Duration::from_millis(ms).as_secs_f64())
}

fn to_json(snapshot: &Snapshot) -> Result<String, Failure> {
    serde_json::to_string(snapshot).map_err(|err| Failure::new(exit::INTERNAL, err.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_holder_shaped_fields_are_lock_holders() {
        let id = "2d241cd5-8c3a-4f1e-9b2a-0c1d2e3f4a5b";
        for owner in [format!("{id}:1"), format!("{id}:12:write")] {
            assert!(is_owner(&owner), "{owner}");
        }
        for other in [
            "views",
            "clicks",
            ":1",
            "abc:",
            "abc:1x",
            "abc:write",
            "mode",
            "user:42",
            "abc:12:write",
            "x:y:3",
        ] {
            assert!(!is_owner(other), "{other}");
        }
    }
}
