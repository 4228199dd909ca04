//! What a name holds in Redis, read without writing: its kind (`none`, a lock, a fair
//! lock, a read-write lock, a semaphore, a number, or another application's key) and, for
//! a lock or a semaphore, its holders. `run` asks it before it takes anything (held.rs),
//! and `status`, `list` and `force-unlock` show it (inspect.rs).
//!
//! A key counts as a lock only when it has a lock's shape: a hash whose fields are
//! holders (`<client id>:<n>`, a writer's `…:write`, a read-write lock's `mode`) with
//! whole-number hold counts. Another application's hash is never shown as a lock.

use serde::Serialize;

use crate::exit::Failure;

/// A lock, or a permit semaphore, as the server has it now.
#[derive(Debug, Serialize)]
pub(crate) struct Snapshot {
    pub(crate) name: String,
    pub(crate) held: bool,
    /// `lock`, `fair lock`, `read-write lock`, `semaphore`, `number` (a count that may be
    /// a semaphore, which distlock did not create), `none`, or `not a lock`.
    pub(crate) kind: String,
    /// For a semaphore or a number: whether `distlock run -n` created it (its mark
    /// `{NAME}:distlock_semaphore` is beside it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) created_by_distlock: Option<bool>,
    /// `read` or `write`, for a read-write lock.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) mode: Option<String>,
    pub(crate) holders: Vec<Holder>,
    /// Milliseconds; absent when free or without expiry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) lease_remaining_ms: Option<u64>,
    /// Waiters queued (a fair lock).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) queued: Option<u64>,
    /// Free permits (a semaphore).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) free_permits: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) last_fencing_token: Option<u64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct Holder {
    /// The holder's id: a lock's owner field, or a permit's id.
    pub(crate) owner: String,
    pub(crate) holds: u64,
    /// A permit's own lease, milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) lease_remaining_ms: Option<u64>,
    /// Who it is: host, pid, command, start (`host`, `pid`, `command_pid`, `command`,
    /// `started_at_ms`), when its distlock recorded it (src/holder.rs).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub(crate) info: Option<crate::holder::Info>,
    /// `started_at_ms` as a UTC time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) started_at: Option<String>,
}

impl Snapshot {
    pub(crate) fn free(name: &str, kind: &str) -> Snapshot {
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

/// `<prefix>:{<name>}`, a helper key or channel before the name (`<prefix>:<name>` when
/// the name has a hash tag of its own), as the library's layout names them.
pub(crate) fn helper(name: &str, prefix: &str) -> String {
    if name.contains('{') {
        format!("{prefix}:{name}")
    } else {
        format!("{prefix}:{{{name}}}")
    }
}

/// `{<name>}`, or the name when it has a hash tag of its own: what the read-write lock's
/// hold keys start with (`<base>:<owner>:rwlock_timeout:<n>`).
pub(crate) fn base(name: &str) -> String {
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
pub(crate) async fn kind_of(client: &distlock::Client, name: &str) -> Result<String, Failure> {
    if client.store() != distlock::StoreKind::Redis {
        return Ok(lease_snapshot(client, name).await?.kind);
    }
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
pub(crate) async fn snapshot(client: &distlock::Client, name: &str) -> Result<Snapshot, Failure> {
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
pub(crate) async fn holding(client: &distlock::Client, name: &str) -> Result<Snapshot, Failure> {
    if client.store() != distlock::StoreKind::Redis {
        return lease_snapshot(client, name).await;
    }
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
pub(crate) const MOST_LOCK_FIELDS: i64 = 1024;

pub(crate) async fn lock_snapshot(
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
pub(crate) async fn hash_shape(
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
pub(crate) async fn live_readers(
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
pub(crate) const MOST_HOLD_KEYS: u64 = 1024;

/// A permit semaphore (`distlock run -n`): its free count at the name, and its permits,
/// each with its lease, in `{name}:timeout`.
pub(crate) async fn permit_snapshot(
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
        .get(crate::mark::semaphore_mark(name))
        .query_async(&mut connection)
        .await?;
    // The mark of `q` and of `{q}` is one key: it holds the name it was made for.
    let created = crate::mark::marks(mark.as_deref(), name);
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
pub(crate) fn is_owner(field: &str) -> bool {
    let field = field.strip_suffix(":write").unwrap_or(field);
    let Some((client, number)) = field.rsplit_once(':') else {
        return false;
    };
    !number.is_empty() && number.bytes().all(|byte| byte.is_ascii_digit()) && is_uuid(client)
}

/// `8-4-4-4-12` hexadecimal digits.
pub(crate) fn is_uuid(text: &str) -> bool {
    let groups: Vec<&str> = text.split('-').collect();
    groups.iter().map(|group| group.len()).eq([8, 4, 4, 4, 12])
        && groups
            .iter()
            .all(|group| group.bytes().all(|byte| byte.is_ascii_hexdigit()))
}

/// What `name` holds on a store other than Redis, read through the library: only locks
/// live there (in distlock's own table), so it is a lock or nothing.
async fn lease_snapshot(client: &distlock::Client, name: &str) -> Result<Snapshot, Failure> {
    let lock = client.lock(name.to_owned())?;
    let owners = lock.owners().await?;
    let lease = lock.remaining_ttl().await?;
    let last_fencing_token = lock.last_fencing_token().await?;
    let held = !owners.is_empty();
    Ok(Snapshot {
        name: name.to_owned(),
        held,
        kind: if held { "lock" } else { "none" }.into(),
        created_by_distlock: None,
        mode: None,
        holders: owners
            .into_iter()
            .map(|owner| Holder {
                owner,
                holds: 1,
                lease_remaining_ms: None,
                info: None,
                started_at: None,
            })
            .collect(),
        lease_remaining_ms: lease
            .filter(|_| held)
            .map(|left| u64::try_from(left.as_millis()).unwrap_or(u64::MAX)),
        queued: None,
        free_permits: None,
        last_fencing_token: Some(last_fencing_token),
    })
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
