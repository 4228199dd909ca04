//! The permit semaphore on PostgreSQL: a semaphore is a row with its total, each
//! acquisition a row with its permits and its own expiry, and every decision is made
//! under the semaphore's row. The scenarios every store passes (tests/common/permits.rs),
//! then what is PostgreSQL's own: a killed holder's permits come back at its lease's end,
//! and a table cleared by hand loses the permits it held.

use std::time::Duration;

use super::common::{self, bounded, permits};
use super::{behind_proxy, client_at, database, raw, LIMIT};

#[tokio::test]
async fn holders_never_hold_more_permits_than_there_are() {
    let server = database().await;
    let clients = [
        client_at(&server.url(), Duration::from_secs(5)).await,
        client_at(&server.url(), Duration::from_secs(5)).await,
    ];
    let most = bounded(
        LIMIT,
        permits::holders_never_hold_more_permits_than_there_are(&clients, "pg:sem:table"),
    )
    .await;
    assert!(most > 1, "the permits were never shared");
}

#[tokio::test]
async fn a_release_wakes_a_waiter_at_once() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(30)).await;
    let other = client_at(&server.url(), Duration::from_secs(30)).await;
    bounded(
        LIMIT,
        permits::a_release_wakes_a_waiter_at_once(&client, &other, "pg:sem:wake"),
    )
    .await;
}

#[tokio::test]
async fn fixed_and_watchdog_leases() {
    let server = database().await;
    let lease = Duration::from_millis(800);
    let client = client_at(&server.url(), lease).await;
    let other = client_at(&server.url(), lease).await;
    bounded(LIMIT, async {
        permits::a_fixed_lease_runs_out_and_says_so(&client, "pg:sem:fixed").await;
        permits::watchdog_permits_outlive_their_lease(&client, &other, "pg:sem:renewed", lease)
            .await;
    })
    .await;
}

#[tokio::test]
async fn counts_cancellation_and_bad_asks() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(5)).await;
    bounded(LIMIT, async {
        assert_eq!(
            permits::counts_and_bad_asks(&client, "pg:sem:counts").await,
            -2
        );
        permits::cancellation_leaves_no_permit_taken(&client, "pg:sem:cancel").await;
    })
    .await;
    // Nothing is left taken in the table either.
    let pool = raw(&server).await;
    let live: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM distlock_permits WHERE expires_at > clock_timestamp()",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(live, 0);
}

#[tokio::test]
async fn a_holder_cut_off_learns_of_its_loss_before_another_takes_its_permits() {
    let server = database().await;
    let (proxy, through_proxy) = behind_proxy(&server).await;
    let lease = Duration::from_millis(1500);
    let holder = client_at(&through_proxy, lease).await;
    let other = client_at(&server.url(), Duration::from_secs(5)).await;
    let cut = common::cut_switch(std::slice::from_ref(&proxy));
    bounded(
        LIMIT,
        permits::a_holder_cut_off_learns_of_its_loss_before_another_takes_its_permits(
            (&holder, &other),
            "pg:sem:cut-off",
            (lease, Duration::from_millis(300)),
            cut,
        ),
    )
    .await;
}

/// Entry point of the child process of the test below; skipped in a normal run.
#[tokio::test]
#[ignore = "run as a child process by a_killed_holders_permits_come_back_at_its_leases_end"]
async fn child_taking_a_permit() {
    let Ok(url) = std::env::var("DISTLOCK_PG_PERMIT_CHILD") else {
        panic!("run only as a child of a_killed_holders_permits_come_back_at_its_leases_end");
    };
    let client = client_at(&url, Duration::from_millis(1000)).await;
    permits::child_takes_a_permit(&client, "pg:sem:killed").await;
}

/// kill -9 of a process holding a renewed permit: the permit is renewed past its 1 s
/// lease while the process lives, and comes back within a lease of the kill.
#[tokio::test]
async fn a_killed_holders_permits_come_back_at_its_leases_end() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_secs(5)).await;
    bounded(
        LIMIT,
        permits::a_killed_holders_permits_come_back(
            &client,
            "pg:sem:killed",
            (
                "postgres_permits::child_taking_a_permit",
                "DISTLOCK_PG_PERMIT_CHILD",
                &server.url(),
            ),
            (Duration::from_millis(2500), Duration::from_millis(1800)),
        ),
    )
    .await;
}

/// An operator who clears the permits table (TRUNCATE) takes every permit: their holders'
/// renewals find no row and signal the loss, and the permits are free at once.
#[tokio::test]
async fn a_cleared_table_loses_the_permits_it_held() {
    let server = database().await;
    let client = client_at(&server.url(), Duration::from_millis(900)).await;
    let pool = raw(&server).await;
    bounded(LIMIT, async {
        let semaphore = client.permit_semaphore("pg:sem:cleared").unwrap();
        assert!(semaphore.try_set_permits(1).await.unwrap().is_set());
        let permits = semaphore.acquire(1).await.unwrap();
        sqlx::query("TRUNCATE distlock_permits")
            .execute(&pool)
            .await
            .unwrap();
        assert!(!permits.verify().await.unwrap());
        permits.lost().await;
        let again = semaphore.try_acquire(1).await.unwrap().expect("free again");
        assert!(permits.release().await.unwrap().was_lost());
        again.release().await.unwrap();
    })
    .await;
}
