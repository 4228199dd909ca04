//! `distlock status`, `list` and `force-unlock`: what an operator asks about a lock.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Duration;

use serde::Serialize;

use crate::args::{ForceUnlock, List, Status};
use crate::exit::{self, Failure};

/// A lock as the server has it now.
#[derive(Debug, Serialize)]
struct Snapshot {
    name: String,
    held: bool,
    /// `lock`, `fair lock`, `read-write lock`, `semaphore`, or `none`.
    kind: String,
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
    owner: String,
    holds: u64,
}

/// `distlock status NAME`.
pub async fn status(client: &distlock::Client, args: &Status) -> Result<u8, Failure> {
    let snapshot = snapshot(client, &args.name).await?;
    if args.json {
        println!("{}", to_json(&snapshot)?);
        return Ok(0);
    }
    println!("name:        {}", snapshot.name);
    println!("held:        {}", if snapshot.held { "yes" } else { "no" });
    println!(
        "kind:        {}{}",
        snapshot.kind,
        snapshot
            .mode
            .as_deref()
            .map(|mode| format!(" ({mode})"))
            .unwrap_or_default()
    );
    for holder in &snapshot.holders {
        println!("holder:      {} (holds {})", holder.owner, holder.holds);
    }
    if let Some(lease) = snapshot.lease_remaining_ms {
        println!("lease left:  {}", seconds(lease));
    }
    if let Some(queued) = snapshot.queued {
        println!("queued:      {queued}");
    }
    if let Some(free) = snapshot.free_permits {
        println!("free:        {free} permits");
    }
    if let Some(token) = snapshot.last_fencing_token {
        println!("last token:  {token}");
    }
    Ok(0)
}

/// `distlock list [PATTERN]`.
pub async fn list(client: &distlock::Client, args: &List) -> Result<u8, Failure> {
    if client.is_cluster() {
        return Err(Failure::new(
            exit::USAGE,
            "list scans one server, and a cluster spreads locks over its masters: run it \
             against each master's URL",
        ));
    }
    let mut connection = client.connection();
    let mut cursor: u64 = 0;
    let mut found = Vec::new();
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&args.pattern)
            .arg("COUNT")
            .arg(1000)
            .arg("TYPE")
            .arg("hash")
            .query_async(&mut connection)
            .await?;
        for key in keys {
            let snapshot = snapshot(client, &key).await?;
            // Hashes of other apps, or a lock released since the scan saw it.
            if snapshot.held && snapshot.kind != "none" {
                found.push(snapshot);
            }
        }
        if next == 0 {
            break;
        }
        cursor = next;
    }
    found.sort_by(|a, b| a.name.cmp(&b.name));
    if args.json {
        for snapshot in &found {
            println!("{}", to_json(snapshot)?);
        }
        return Ok(0);
    }
    println!(
        "{:<32} {:<16} {:>10} {:>6}  HOLDER",
        "NAME", "KIND", "LEASE LEFT", "HOLDS"
    );
    for snapshot in &found {
        let kind = match &snapshot.mode {
            Some(mode) => format!("{} ({mode})", snapshot.kind),
            None => snapshot.kind.clone(),
        };
        let lease = snapshot
            .lease_remaining_ms
            .map(seconds)
            .unwrap_or_else(|| "-".into());
        for holder in &snapshot.holders {
            println!(
                "{:<32} {:<16} {:>10} {:>6}  {}",
                snapshot.name, kind, lease, holder.holds, holder.owner
            );
        }
    }
    Ok(0)
}

/// `distlock force-unlock NAME`.
pub async fn force_unlock(client: &distlock::Client, args: &ForceUnlock) -> Result<u8, Failure> {
    let snapshot = snapshot(client, &args.name).await?;
    if !snapshot.held {
        println!("{} is not locked", args.name);
        return Ok(0);
    }
    if !args.yes {
        let stdin = std::io::stdin();
        if !stdin.is_terminal() {
            return Err(Failure::new(
                exit::USAGE,
                "force-unlock asks before it deletes a lock, and stdin is not a terminal: pass --yes",
            ));
        }
        let holders: Vec<&str> = snapshot
            .holders
            .iter()
            .map(|holder| holder.owner.as_str())
            .collect();
        print!(
            "Delete {} held by {}? Its holder's command is stopped. [y/N] ",
            args.name,
            holders.join(", ")
        );
        let _ = std::io::stdout().flush();
        let mut answer = String::new();
        stdin
            .lock()
            .read_line(&mut answer)
            .map_err(|err| Failure::new(exit::INTERNAL, err.to_string()))?;
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            println!("not deleted");
            return Ok(1);
        }
    }
    let deleted = client.lock(args.name.clone())?.force_unlock().await?;
    println!(
        "{}",
        if deleted {
            format!("{} unlocked", args.name)
        } else {
            format!("{} is not locked", args.name)
        }
    );
    Ok(0)
}

/// Reads what `name` holds.
async fn snapshot(client: &distlock::Client, name: &str) -> Result<Snapshot, Failure> {
    let lock = client.lock(name.to_owned())?;
    let mut connection = client.connection();
    let key = lock.key().to_owned();
    let (kind, pttl): (String, i64) = redis::pipe()
        .cmd("TYPE")
        .arg(&key)
        .pttl(&key)
        .query_async(&mut connection)
        .await?;
    let mut snapshot = Snapshot {
        name: name.to_owned(),
        held: false,
        kind: "none".into(),
        mode: None,
        holders: Vec::new(),
        lease_remaining_ms: u64::try_from(pttl).ok(),
        queued: None,
        free_permits: None,
        last_fencing_token: None,
    };
    match kind.as_str() {
        "hash" => {
            let fields: Vec<(String, String)> = redis::cmd("HGETALL")
                .arg(&key)
                .query_async(&mut connection)
                .await?;
            for (field, value) in fields {
                if field == "mode" {
                    snapshot.mode = Some(value);
                    continue;
                }
                // A lock's fields are owners with hold counts; another app's hash is not
                // a lock.
                let Ok(holds) = value.parse::<u64>() else {
                    return Ok(Snapshot {
                        held: false,
                        kind: "none".into(),
                        holders: Vec::new(),
                        ..snapshot
                    });
                };
                snapshot.holders.push(Holder {
                    owner: field,
                    holds,
                });
            }
            snapshot.held = !snapshot.holders.is_empty();
            let queued = client.fair_lock(name.to_owned())?.queued().await?;
            snapshot.kind = if snapshot.mode.is_some() {
                "read-write lock".into()
            } else if queued > 0 {
                "fair lock".into()
            } else {
                "lock".into()
            };
            snapshot.queued = (queued > 0).then_some(queued as u64);
            snapshot.last_fencing_token = Some(lock.last_fencing_token().await?);
        }
        "string" => {
            let free: Option<String> = redis::cmd("GET")
                .arg(&key)
                .query_async(&mut connection)
                .await?;
            if let Some(free) = free.and_then(|free| free.parse::<i64>().ok()) {
                snapshot.kind = "semaphore".into();
                snapshot.free_permits = Some(free);
            }
        }
        _ => {}
    }
    Ok(snapshot)
}

fn seconds(ms: u64) -> String {
    format!("{:.1}s", Duration::from_millis(ms).as_secs_f64())
}

fn to_json(snapshot: &Snapshot) -> Result<String, Failure> {
    serde_json::to_string(snapshot).map_err(|err| Failure::new(exit::INTERNAL, err.to_string()))
}
