//! ACL users: the minimal ACL documented in docs/safety.md is enough for every lock
//! operation, and a user missing part of it gets a typed error from a call that changed
//! nothing, never a half-done release or a reconnect loop.

mod common;

use std::time::Duration;

use common::{bounded, holds, raw, server, until_subscribers};
use distlock::{Client, Error};
use distlock_testkit::RedisServer;
use tokio::time::Instant;

const LIMIT: Duration = Duration::from_secs(30);

/// The rules of the documented minimal ACL, read from docs/safety.md: the test runs what
/// the docs promise, not a copy that could drift from them.
fn documented_acl() -> Vec<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/safety.md");
    let doc = std::fs::read_to_string(path).expect("read docs/safety.md");
    let section = doc
        .split("### The minimal ACL")
        .nth(1)
        .expect("docs/safety.md has a minimal ACL section");
    let block = section
        .split("```text")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the minimal ACL section has a text block");
    block
        .split_whitespace()
        .map(|rule| rule.replace(">change-me", ">pw"))
        .collect()
}

/// Creates `user` with the documented rules minus those in `without`, and returns the
/// URL a client connects with as that user.
async fn user(server: &RedisServer, user: &str, without: &[&str]) -> String {
    let rules: Vec<String> = documented_acl()
        .into_iter()
        .filter(|rule| !without.contains(&rule.as_str()))
        .collect();
    assert_eq!(
        rules.len() + without.len(),
        documented_acl().len(),
        "every rule left out must be in the documented ACL: {without:?}"
    );
    let mut admin = raw(server).await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(user)
        .arg(&rules)
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    format!("redis://{user}:pw@127.0.0.1:{}/", server.port())
}

/// A client for `url` with a short watchdog, so renewals happen within the test.
async fn client_as(url: &str) -> Client {
    Client::builder()
        .watchdog_timeout(Duration::from_millis(600))
        .connect(url)
        .await
        .expect("connect as the ACL user")
}

/// How many connections the server has accepted so far.
async fn connections_received(conn: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("stats")
        .query_async(conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|line| line.strip_prefix("total_connections_received:"))
        .and_then(|count| count.trim().parse().ok())
        .expect("total_connections_received in INFO stats")
}

/// Whether `owner` still has its field in the lock hash `name`.
async fn owner_holds(
    admin: &mut redis::aio::MultiplexedConnection,
    name: &str,
    owner: &str,
) -> bool {
    redis::cmd("HEXISTS")
        .arg(name)
        .arg(owner)
        .query_async::<i64>(admin)
        .await
        .unwrap()
        == 1
}

/// Releases `guard` while `waiting` waits for the same lock; returns how long after the
/// release the waiter got it, and releases the waiter's guard. A waiter woken by the
/// release message gets it within a few round trips.
async fn handoff(
    guard: distlock::LockGuard,
    waiting: tokio::task::JoinHandle<distlock::Result<distlock::LockGuard>>,
) -> Duration {
    let released_at = Instant::now();
    guard.release().await.unwrap();
    let handed = waiting.await.unwrap().unwrap();
    let handoff = released_at.elapsed();
    handed.release().await.unwrap();
    handoff
}

#[tokio::test]
async fn the_documented_minimal_acl_runs_every_lock_operation() {
    let server = server().await;
    let url = user(&server, "locks", &[]).await;
    let holder = client_as(&url).await;
    let rival = client_as(&url).await;
    let admin = raw(&server).await;
    bounded(LIMIT, async {
        let lock = holder.lock("app:ledger").unwrap();
        let guard = lock.lock().await.unwrap();
        // Renewed past two watchdog leases.
        tokio::time::sleep(Duration::from_millis(1300)).await;
        assert!(!guard.is_lost(), "the watchdog could not renew");
        assert!(lock.is_locked().await.unwrap());
        assert!(lock.remaining_ttl().await.unwrap().is_some());
        let nested = guard.reenter().await.unwrap();
        nested.release().await.unwrap();

        // A waiter is woken by the release message, which needs the channel rights.
        let waiting = rival.lock("app:ledger").unwrap();
        let waiter = tokio::spawn(async move { waiting.lock().await });
        until_subscribers(&admin, "redisson_lock__channel:{app:ledger}", 1).await;
        let handoff = handoff(guard, waiter).await;
        assert!(
            handoff < Duration::from_millis(200),
            "handoff took {handoff:?}: the waiter was not woken by the release"
        );

        let forced = lock.lock().await.unwrap();
        assert!(lock.force_unlock().await.unwrap());
        assert!(
            forced.release().await.unwrap().was_lost(),
            "force_unlock freed it"
        );
        // The fair lock: a queue, a direct grant on the waiter's own channel, a timeout.
        let fair = holder.fair_lock("app:payouts").unwrap();
        let first = fair.lock().await.unwrap();
        let queued = rival.fair_lock("app:payouts").unwrap();
        assert!(queued
            .try_lock_for(Duration::from_millis(100))
            .await
            .unwrap()
            .is_none());
        let next = tokio::spawn(async move { queued.lock().await });
        common::eventually(Duration::from_secs(5), "a fair waiter queued", || {
            let fair = fair.clone();
            async move { fair.queued().await.unwrap() == 1 }
        })
        .await;
        first.release().await.unwrap();
        let granted = next.await.unwrap().unwrap();
        assert!(granted.verify().await.unwrap());
        granted.release().await.unwrap();

        // The rest of the family: a read-write lock (a read hold renewed past its lease, a
        // writer woken by the read release), semaphores, a latch.
        let rw = holder.rw_lock("app:doc").unwrap();
        let reader = rw.read().await.unwrap();
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(
            reader.verify().await.unwrap(),
            "a read hold was not renewed"
        );
        let writing = tokio::spawn({
            let rw = rival.rw_lock("app:doc").unwrap();
            async move { rw.write().await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        reader.release().await.unwrap();
        writing.await.unwrap().unwrap().release().await.unwrap();
        let pool = holder.semaphore("app:pool").unwrap();
        assert!(pool.try_set_permits(1).await.unwrap().is_set());
        pool.acquire(1).await.unwrap().release().await.unwrap();
        let gpus = holder.permit_semaphore("app:gpus").unwrap();
        assert!(gpus.try_set_permits(1).await.unwrap().is_set());
        let permit = gpus.acquire(1).await.unwrap();
        tokio::time::sleep(Duration::from_millis(800)).await;
        assert!(!permit.is_lost(), "a permit was not renewed");
        permit.release().await.unwrap();
        let latch = holder.count_down_latch("app:latch").unwrap();
        latch.try_set_count(1).await.unwrap();
        let waiting = tokio::spawn({
            let latch = rival.count_down_latch("app:latch").unwrap();
            async move { latch.wait_for(Duration::from_secs(5)).await }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        latch.count_down().await.unwrap();
        assert!(waiting.await.unwrap().unwrap());

        common::eventually(Duration::from_secs(5), "latches deleted", || {
            let mut admin = admin.clone();
            async move {
                let left: Vec<String> = redis::cmd("KEYS")
                    .arg("redisson_unlock_latch:*")
                    .query_async(&mut admin)
                    .await
                    .unwrap();
                left.is_empty()
            }
        })
        .await;
    })
    .await;
    holder.shutdown().await;
    rival.shutdown().await;
}

#[tokio::test]
async fn a_user_without_the_release_channels_gets_a_typed_error_and_keeps_the_lock() {
    let server = server().await;
    let url = user(&server, "nochannels", &["&redisson_lock__channel:*"]).await;
    let holder = client_as(&url).await;
    let rival = client_as(&url).await;
    let mut admin = raw(&server).await;
    bounded(LIMIT, async {
        let lease = Duration::from_millis(800);
        let lock = holder.lock("app:report").unwrap().with_lease(lease);
        let guard = lock.lock().await.unwrap();
        let name = guard.name().to_owned();
        let owner = guard.owner().to_owned();
        let refused = guard.release().await;
        assert!(
            matches!(&refused, Err(Error::NoPermission { detail, .. }) if detail.contains("channel")),
            "release without channel rights: {refused:?}"
        );
        assert!(
            owner_holds(&mut admin, &name, &owner).await,
            "a refused release must leave the lock as it was"
        );
        let forced = lock.force_unlock().await;
        assert!(
            matches!(forced, Err(Error::NoPermission { .. })),
            "{forced:?}"
        );
        assert!(lock.is_locked().await.unwrap(), "a refused force_unlock deleted the lock");

        // A waiter cannot be woken, so it looks again and gets the lock once the lease
        // has run out; its pub/sub connection is not rebuilt in a loop meanwhile.
        let before = connections_received(&mut admin).await;
        let started = Instant::now();
        let got = rival.lock("app:report").unwrap().lock().await.unwrap();
        let waited = started.elapsed();
        let after = connections_received(&mut admin).await;
        assert!(
            waited < lease + Duration::from_millis(600),
            "the waiter took {waited:?} for a lease of {lease:?}"
        );
        assert!(
            after - before <= 1,
            "{} connections opened while waiting: a reconnect loop",
            after - before
        );
        let refused = got.release().await;
        assert!(
            matches!(refused, Err(Error::NoPermission { .. })),
            "the waiter's release without channel rights: {refused:?}"
        );
    })
    .await;
    holder.shutdown().await;
    rival.shutdown().await;
}

#[tokio::test]
async fn a_user_without_the_latch_keys_gets_a_typed_error_and_keeps_the_lock() {
    let server = server().await;
    let url = user(&server, "nolatch", &["~redisson_unlock_latch:*"]).await;
    let client = client_as(&url).await;
    let mut admin = raw(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("app:batch").unwrap();
        let guard = lock.lock().await.unwrap();
        let nested = guard.reenter().await.unwrap();
        // A partial release writes no latch: allowed.
        nested.release().await.unwrap();
        assert!(holds(&mut admin, &guard).await);
        let name = guard.name().to_owned();
        let owner = guard.owner().to_owned();
        let refused = guard.release().await;
        assert!(
            matches!(refused, Err(Error::NoPermission { .. })),
            "{refused:?}"
        );
        assert!(
            owner_holds(&mut admin, &name, &owner).await,
            "a refused release must leave the lock as it was"
        );
    })
    .await;
    client.shutdown().await;
}

/// A user without `rules` tries to lock: the acquisition is refused with a typed error,
/// and leaves no key at all behind (no lock, no lock without a lease, no token taken).
async fn refused_acquisition_leaves_nothing(name: &str, without: &[&str]) {
    let server = server().await;
    let url = user(&server, name, without).await;
    let client = client_as(&url).await;
    let refused = bounded(LIMIT, client.lock("app:refused").unwrap().try_lock()).await;
    assert!(
        matches!(refused, Err(Error::NoPermission { .. })),
        "without {without:?}: {refused:?}"
    );
    let mut admin = raw(&server).await;
    let left: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        left.is_empty(),
        "without {without:?}, a refused acquisition left keys: {left:?}"
    );
    client.shutdown().await;
}

#[tokio::test]
async fn a_user_without_the_fencing_counters_cannot_lock_and_leaves_nothing() {
    refused_acquisition_leaves_nothing("nofence", &["~distlock_fence:*"]).await;
}

#[tokio::test]
async fn a_user_without_pexpire_cannot_lock_and_leaves_no_lock_without_a_lease() {
    refused_acquisition_leaves_nothing("nopexpire", &["+pexpire"]).await;
}

#[tokio::test]
async fn a_user_without_pexpire_or_del_cannot_lock_and_leaves_nothing() {
    refused_acquisition_leaves_nothing("nolease", &["+pexpire", "+del"]).await;
}

/// Waits for the next message on `pubsub`, and returns its payload.
async fn next_message(pubsub: &mut redis::aio::PubSub) -> String {
    use futures_util::StreamExt;
    let message = bounded(LIMIT, pubsub.on_message().next())
        .await
        .expect("pub/sub stream open");
    message.get_payload().unwrap()
}

#[tokio::test]
async fn a_user_without_del_gets_a_typed_error_and_wakes_nobody() {
    let server = server().await;
    let url = user(&server, "nodel", &["+del"]).await;
    let client = client_as(&url).await;
    let mut admin = raw(&server).await;
    let channel = "redisson_lock__channel:{app:refused}";
    let mut pubsub = server.client().unwrap().get_async_pubsub().await.unwrap();
    pubsub.subscribe(channel).await.unwrap();
    bounded(LIMIT, async {
        let guard = client.lock("app:refused").unwrap().lock().await.unwrap();
        let (name, owner) = (guard.name().to_owned(), guard.owner().to_owned());
        let refused = guard.release().await;
        assert!(
            matches!(refused, Err(Error::NoPermission { .. })),
            "{refused:?}"
        );
        assert!(
            owner_holds(&mut admin, &name, &owner).await,
            "a refused release must leave the lock as it was"
        );
        // A refused release announces nothing: the first message on the channel is the
        // marker published after it.
        let _: i64 = redis::cmd("PUBLISH")
            .arg(channel)
            .arg("marker")
            .query_async(&mut admin)
            .await
            .unwrap();
        let first = next_message(&mut pubsub).await;
        assert_eq!(
            first, "marker",
            "a refused release woke waiters for nothing"
        );
    })
    .await;
    client.shutdown().await;
}

#[tokio::test]
async fn a_user_who_may_not_renew_is_told_its_lease_is_lost_at_the_first_renewal() {
    let server = server().await;
    let url = user(&server, "norenew", &["+type"]).await;
    // Watchdog 600 ms: the first renewal is due at 200 ms, the deadline at 600 ms.
    let client = client_as(&url).await;
    bounded(LIMIT, async {
        let acquired = Instant::now();
        let guard = client.lock("app:norenew").unwrap().lock().await.unwrap();
        guard.lost().await;
        let after = acquired.elapsed();
        assert!(
            after < Duration::from_millis(450),
            "the lost signal fired {after:?} after acquiring: it waited for the deadline \
             instead of reporting the refused renewal"
        );
    })
    .await;
    client.shutdown().await;
}

#[tokio::test]
async fn a_user_without_unsubscribe_keeps_its_pubsub_connection() {
    let server = server().await;
    let url = user(&server, "nounsub", &["+unsubscribe"]).await;
    let holder = client_as(&url).await;
    let waiter = client_as(&url).await;
    let mut admin = raw(&server).await;
    bounded(LIMIT, async {
        let before = connections_received(&mut admin).await;
        for round in 0..3 {
            let name = format!("app:unsub-{round}");
            let guard = holder.lock(name.as_str()).unwrap().lock().await.unwrap();
            let lock = waiter.lock(name.as_str()).unwrap();
            let waiting = tokio::spawn(async move { lock.lock().await });
            until_subscribers(&admin, &format!("redisson_lock__channel:{{{name}}}"), 1).await;
            let handoff = handoff(guard, waiting).await;
            assert!(
                handoff < Duration::from_millis(200),
                "round {round}: handoff took {handoff:?}"
            );
        }
        let opened = connections_received(&mut admin).await - before;
        assert!(
            opened <= 1,
            "{opened} connections opened: a refused UNSUBSCRIBE was taken for a broken connection"
        );
    })
    .await;
    holder.shutdown().await;
    waiter.shutdown().await;
}

#[tokio::test]
async fn a_channel_right_granted_while_waiting_takes_effect_without_a_restart() {
    let server = server().await;
    let url = user(&server, "latergrant", &["&redisson_lock__channel:*"]).await;
    let waiter = client_as(&url).await;
    let holder = common::client(&server).await;
    let mut admin = raw(&server).await;
    let channel = "redisson_lock__channel:{app:granted}";
    bounded(LIMIT, async {
        let guard = holder.lock("app:granted").unwrap().lock().await.unwrap();
        let lock = waiter.lock("app:granted").unwrap();
        let waiting = tokio::spawn(async move { lock.lock().await });
        // The waiter's subscription is refused (the server logs the refusal).
        common::eventually(Duration::from_secs(5), "a refused subscription", || {
            let mut admin = admin.clone();
            async move {
                let log: redis::Value = redis::cmd("ACL")
                    .arg("LOG")
                    .query_async(&mut admin)
                    .await
                    .unwrap();
                format!("{log:?}").contains("redisson_lock__channel:{app:granted}")
            }
        })
        .await;
        assert_eq!(common::subscribers(&mut admin, channel).await, 0);
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("latergrant")
            .arg("&redisson_lock__channel:*")
            .query_async(&mut admin)
            .await
            .unwrap();
        // The hub asks again by itself; then the release wakes the waiter at once.
        until_subscribers(&admin, channel, 1).await;
        let handoff = handoff(guard, waiting).await;
        assert!(
            handoff < Duration::from_millis(200),
            "handoff took {handoff:?}: the granted channel was not subscribed"
        );
    })
    .await;
    waiter.shutdown().await;
    holder.shutdown().await;
}

#[tokio::test]
async fn a_key_revoked_while_held_loses_only_its_own_lock() {
    let server = server().await;
    let mut rules = documented_acl();
    rules.push("~other:*".into());
    let mut admin = raw(&server).await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("revoked")
        .arg(&rules)
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://revoked:pw@127.0.0.1:{}/", server.port());
    // Watchdog 600 ms: renewals every 200 ms.
    let client = client_as(&url).await;
    bounded(LIMIT, async {
        let kept = client.lock("app:kept").unwrap().lock().await.unwrap();
        let revoked = client.lock("other:revoked").unwrap().lock().await.unwrap();
        let keep_rules: Vec<String> = rules
            .iter()
            .filter(|rule| rule.starts_with('~') && *rule != "~other:*")
            .cloned()
            .collect();
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("revoked")
            .arg("resetkeys")
            .arg(&keep_rules)
            .query_async(&mut admin)
            .await
            .unwrap();
        revoked.lost().await;
        // Two more renewal rounds: the lock the user may still renew stays held.
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(
            !kept.is_lost(),
            "a lock the user may renew was reported lost"
        );
        assert!(
            holds(&mut admin, &kept).await,
            "a lock the user may renew expired"
        );
    })
    .await;
    client.shutdown().await;
}

#[tokio::test]
async fn a_refused_partial_release_keeps_the_hold_count() {
    let server = server().await;
    let url = user(&server, "partial", &[]).await;
    let client = client_as(&url).await;
    let mut admin = raw(&server).await;
    bounded(LIMIT, async {
        let guard = client.lock("app:partial").unwrap().lock().await.unwrap();
        let nested = guard.reenter().await.unwrap();
        let count = |admin: redis::aio::MultiplexedConnection, owner: String| async move {
            let mut admin = admin;
            redis::cmd("HGET")
                .arg("app:partial")
                .arg(owner)
                .query_async::<i64>(&mut admin)
                .await
                .unwrap()
        };
        assert_eq!(count(admin.clone(), guard.owner().to_owned()).await, 2);
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("partial")
            .arg("-pexpire")
            .query_async(&mut admin)
            .await
            .unwrap();
        let refused = nested.release().await;
        assert!(
            matches!(refused, Err(Error::NoPermission { .. })),
            "{refused:?}"
        );
        assert_eq!(
            count(admin.clone(), guard.owner().to_owned()).await,
            2,
            "a refused partial release wrote its hold count"
        );
    })
    .await;
    client.shutdown().await;
}

/// With a key prefix, one key pattern and one channel pattern are the whole ACL: every key
/// and channel the client writes starts with the prefix (issue 21). Two prefixes on one
/// server keep their locks apart.
#[tokio::test]
async fn under_a_key_prefix_one_pattern_is_the_whole_acl() {
    let server = server().await;
    let mut admin = raw(&server).await;
    let mut rules: Vec<String> = documented_acl()
        .into_iter()
        .filter(|rule| !rule.starts_with('~') && !rule.starts_with('&'))
        .collect();
    rules.push("~billing:*".into());
    rules.push("&billing:*".into());
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("billing")
        .arg(&rules)
        .query_async(&mut admin)
        .await
        .unwrap();
    let url = format!("redis://billing:pw@127.0.0.1:{}/", server.port());
    let connect = || {
        Client::builder()
            .watchdog_timeout(Duration::from_millis(600))
            .key_prefix("billing:")
            .connect(&url)
    };
    let holder = connect().await.unwrap();
    let rival = connect().await.unwrap();
    let elsewhere = Client::connect(&server.url()).await.unwrap();
    bounded(LIMIT, async {
        let lock = holder.lock("orders").unwrap();
        assert_eq!((lock.name(), lock.key()), ("orders", "billing:orders"));
        let guard = lock.lock().await.unwrap();
        assert_eq!(guard.name(), "orders");
        // Renewed, re-entered, fenced, handed off on a release message.
        tokio::time::sleep(Duration::from_millis(700)).await;
        assert!(!guard.is_lost());
        guard.reenter().await.unwrap().release().await.unwrap();
        assert!(lock.advance_fencing_counter(100).await.unwrap() >= 100);
        // Another app's lock of the same name is another lock.
        let other_app = elsewhere.lock("orders").unwrap().try_lock().await.unwrap();
        assert!(other_app.is_some(), "the prefix keeps apps apart");
        other_app.unwrap().release().await.unwrap();

        let waiting = rival.lock("orders").unwrap();
        let waiter = tokio::spawn(async move { waiting.lock().await });
        until_subscribers(&admin, "billing:redisson_lock__channel:{billing:orders}", 1).await;
        let handoff = handoff(guard, waiter).await;
        assert!(
            handoff < Duration::from_millis(200),
            "handoff took {handoff:?}"
        );
        let forced = lock.lock().await.unwrap();
        assert!(forced.fencing_token() > 100);
        assert!(lock.force_unlock().await.unwrap());
        assert!(forced.release().await.unwrap().was_lost());

        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("*")
            .query_async(&mut admin)
            .await
            .unwrap();
        let strays: Vec<&String> = keys
            .iter()
            .filter(|key| !key.starts_with("billing:"))
            // The unprefixed client's own counter and (briefly) its latch.
            .filter(|key| !key.starts_with("distlock_fence:"))
            .filter(|key| !key.starts_with("redisson_unlock_latch:{orders}:"))
            .collect();
        assert!(strays.is_empty(), "keys outside the prefix: {strays:?}");
        assert!(
            keys.iter()
                .any(|key| key.starts_with("billing:distlock_fence:")),
            "{keys:?}"
        );
    })
    .await;
    for client in [holder, rival, elsewhere] {
        client.shutdown().await;
    }
}

#[tokio::test]
async fn a_prefix_with_braces_is_refused() {
    let server = server().await;
    for prefix in ["{app}:", "app}", "a{"] {
        let err = Client::builder()
            .key_prefix(prefix)
            .connect(&server.url())
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::InvalidConfig { .. }),
            "{prefix}: {err}"
        );
    }
}

/// Review: a fair release checks every command it may run, reads included, before its
/// first write. Refused one (HGET, revoked while the lock is held), it fails with a typed
/// error and changes nothing: the lock stays the holder's, no latch is left, and the
/// waiter is not handed a lock the release never freed. A user without HGET cannot take a
/// fair lock at all, and that refusal leaves nothing either.
#[tokio::test]
async fn a_fair_release_refused_a_read_changes_nothing() {
    let server = server().await;
    let url = user(&server, "fair", &[]).await;
    let holder = client_as(&url).await;
    let rival = client_as(&url).await;
    let mut admin = raw(&server).await;
    bounded(LIMIT, async {
        let lock = holder.fair_lock("app:refused").unwrap();
        let guard = lock.lock().await.unwrap();
        let waiting = tokio::spawn({
            let lock = rival.fair_lock("app:refused").unwrap();
            async move { lock.try_lock_for(Duration::from_secs(3)).await }
        });
        common::eventually(Duration::from_secs(5), "a fair waiter queued", || {
            let lock = lock.clone();
            async move { lock.queued().await.unwrap() == 1 }
        })
        .await;
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("fair")
            .arg("-hget")
            .query_async(&mut admin)
            .await
            .unwrap();
        let owner = guard.owner().to_owned();
        let refused = guard.release().await;
        assert!(
            matches!(refused, Err(Error::NoPermission { .. })),
            "{refused:?}"
        );
        let holders: Vec<String> = redis::cmd("HKEYS")
            .arg("app:refused")
            .query_async(&mut admin)
            .await
            .unwrap();
        assert_eq!(holders, [owner], "the refused release changed the lock");
        let latches: Vec<String> = redis::cmd("KEYS")
            .arg("redisson_unlock_latch:*")
            .query_async(&mut admin)
            .await
            .unwrap();
        assert!(latches.is_empty(), "{latches:?}");
        // The waiter cannot look at the lock either now; it reports that refusal.
        assert!(matches!(
            waiting.await.unwrap(),
            Err(Error::NoPermission { .. })
        ));
    })
    .await;
    holder.shutdown().await;
    rival.shutdown().await;
}

/// Issue 32: the common fair release (a live distlock waiter at the head, another behind
/// it) checks only the writes it makes, not every command a fair-lock script may run.
/// One of those writes refused (ZINCRBY, which moves the score of the waiter behind the
/// head), the release fails with a typed error before writing anything: the lock stays
/// the holder's, the queue and its scores are as they were, and no latch is left.
#[tokio::test]
async fn a_plain_fair_handoff_refused_a_write_changes_nothing() {
    let server = server().await;
    let url = user(&server, "fairhand", &[]).await;
    let holder = client_as(&url).await;
    let rivals = [client_as(&url).await, client_as(&url).await];
    let mut admin = raw(&server).await;
    bounded(LIMIT, async {
        let lock = holder.fair_lock("app:handoff").unwrap();
        let guard = lock.lock().await.unwrap();
        let mut waiting = Vec::new();
        for (queued, rival) in rivals.iter().enumerate() {
            let rival = rival.fair_lock("app:handoff").unwrap();
            waiting.push(tokio::spawn(async move {
                rival.try_lock_for(Duration::from_secs(3)).await
            }));
            common::eventually(Duration::from_secs(5), "a fair waiter queued", || {
                let lock = lock.clone();
                async move { lock.queued().await.unwrap() == queued + 1 }
            })
            .await;
        }
        let reader = admin.clone();
        let scores = || {
            let mut reader = reader.clone();
            async move {
                redis::cmd("ZRANGE")
                    .arg("redisson_lock_timeout:{app:handoff}")
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES")
                    .query_async::<Vec<(String, String)>>(&mut reader)
                    .await
                    .unwrap()
            }
        };
        let before = scores().await;
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("fairhand")
            .arg("-zincrby")
            .query_async(&mut admin)
            .await
            .unwrap();
        let owner = guard.owner().to_owned();
        let refused = guard.release().await;
        assert!(
            matches!(refused, Err(Error::NoPermission { .. })),
            "{refused:?}"
        );
        let holders: Vec<String> = redis::cmd("HKEYS")
            .arg("app:handoff")
            .query_async(&mut admin)
            .await
            .unwrap();
        assert_eq!(holders, [owner], "the refused release changed the lock");
        assert_eq!(
            scores().await,
            before,
            "the refused release changed the queue"
        );
        let queue: Vec<String> = redis::cmd("LRANGE")
            .arg("redisson_lock_queue:{app:handoff}")
            .arg(0)
            .arg(-1)
            .query_async(&mut admin)
            .await
            .unwrap();
        assert_eq!(queue.len(), 2, "{queue:?}");
        let latches: Vec<String> = redis::cmd("KEYS")
            .arg("redisson_unlock_latch:*")
            .query_async(&mut admin)
            .await
            .unwrap();
        assert!(latches.is_empty(), "{latches:?}");
        for waiter in waiting {
            waiter.abort();
        }
    })
    .await;
    holder.shutdown().await;
    for rival in rivals {
        rival.shutdown().await;
    }
}

/// Issue 32: a waiter queueing behind a holder and another waiter checks only its own
/// entry's writes. One of them refused (ZADD), its attempt fails with a typed error and
/// writes nothing: the queue, its scores and distlock's waiters hold the first waiter
/// alone. (The first waiter of a queue takes the general path: it sets the keys' expiry.)
#[tokio::test]
async fn a_plain_fair_queueing_refused_a_write_leaves_nothing() {
    let server = server().await;
    let url = user(&server, "fairjoin", &[]).await;
    let holder = client_as(&url).await;
    let (first, second) = (client_as(&url).await, client_as(&url).await);
    let mut admin = raw(&server).await;
    bounded(LIMIT, async {
        let lock = holder.fair_lock("app:join").unwrap();
        let guard = lock.lock().await.unwrap();
        let queued = tokio::spawn({
            let lock = first.fair_lock("app:join").unwrap();
            async move { lock.try_lock_for(Duration::from_secs(3)).await }
        });
        common::eventually(Duration::from_secs(5), "a fair waiter queued", || {
            let lock = lock.clone();
            async move { lock.queued().await.unwrap() == 1 }
        })
        .await;
        let _: () = redis::cmd("ACL")
            .arg("SETUSER")
            .arg("fairjoin")
            .arg("-zadd")
            .query_async(&mut admin)
            .await
            .unwrap();
        let refused = second
            .fair_lock("app:join")
            .unwrap()
            .try_lock_for(Duration::from_secs(2))
            .await;
        assert!(
            matches!(refused, Err(Error::NoPermission { .. })),
            "{refused:?}"
        );
        let queue: Vec<String> = redis::cmd("LRANGE")
            .arg("redisson_lock_queue:{app:join}")
            .arg(0)
            .arg(-1)
            .query_async(&mut admin)
            .await
            .unwrap();
        assert_eq!(
            queue.len(),
            1,
            "the refused attempt wrote the queue: {queue:?}"
        );
        for (key, command) in [
            ("redisson_lock_timeout:{app:join}", "ZCARD"),
            ("distlock_fair_waiters:{app:join}", "HLEN"),
        ] {
            let entries: i64 = redis::cmd(command)
                .arg(key)
                .query_async(&mut admin)
                .await
                .unwrap();
            assert_eq!(entries, 1, "the refused attempt wrote {key}");
        }
        assert!(guard.verify().await.unwrap());
        queued.abort();
    })
    .await;
    holder.shutdown().await;
    first.shutdown().await;
    second.shutdown().await;
}

/// Issue 30 (1.1), for a user whose ACL was written before `+persist` was in the
/// documented minimal ACL: a Redisson waiter queued behind a distlock waiter still keeps
/// its entry when the distlock waiter is handed the lock, because the queue's keys are set
/// to last one wait past the last score instead of being made persistent.
#[tokio::test]
async fn a_fair_queue_outlasts_a_redisson_waiter_without_persist() {
    use common::redisson_fair::{assert_entry_outlasted, queue, redisson_acquire};
    let server = server().await;
    let url = user(&server, "older", &["+persist"]).await;
    let holder = client_as(&url).await;
    let waiter = client_as(&url).await;
    let mut admin = raw(&server).await;
    bounded(LIMIT, async {
        let held = holder.fair_lock("app:older").unwrap().lock().await.unwrap();
        let waiting = tokio::spawn({
            let lock = waiter.fair_lock("app:older").unwrap();
            async move { lock.lock().await }
        });
        common::eventually(Duration::from_secs(5), "a fair waiter queued", || {
            let mut admin = admin.clone();
            async move {
                let queued: i64 = redis::cmd("LLEN")
                    .arg(queue("app:older"))
                    .query_async(&mut admin)
                    .await
                    .unwrap();
                queued == 1
            }
        })
        .await;
        assert!(!redisson_acquire(&mut admin, "app:older", "r:1").await);
        held.release().await.unwrap();
        let guard = waiting.await.unwrap().unwrap();
        let pttl: i64 = redis::cmd("PTTL")
            .arg(queue("app:older"))
            .query_async(&mut admin)
            .await
            .unwrap();
        assert!(pttl > 0, "without PERSIST the keys keep an expiry: {pttl}");
        assert_entry_outlasted(&mut admin, "app:older", "r:1").await;
        guard.release().await.unwrap();
    })
    .await;
    holder.shutdown().await;
    waiter.shutdown().await;
}
