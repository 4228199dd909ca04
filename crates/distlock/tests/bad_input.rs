//! Bad input gets a typed error, never a panic or a hang.

mod common;

use std::io::Write;
use std::time::Duration;

use common::{bounded, client, raw, server};
use distlock::{Client, Error};
use redis::AsyncCommands;

const LIMIT: Duration = Duration::from_secs(20);

#[tokio::test]
async fn an_empty_name_is_refused() {
    let server = server().await;
    let client = client(&server).await;
    assert!(matches!(client.lock(""), Err(Error::InvalidName { .. })));
}

/// A name whose helper keys would hash to another Cluster slot than the lock is refused
/// on every deployment, so a name that works on one Redis works on a Cluster too.
#[tokio::test]
async fn a_name_that_cannot_share_one_slot_is_refused() {
    let server = server().await;
    let client = client(&server).await;
    for name in ["a}b", "order}42", "a{}b"] {
        let refused = client.lock(name).expect_err("refused");
        assert!(
            matches!(refused, Error::InvalidName { .. }) && refused.to_string().contains("slot"),
            "{name}: {refused}"
        );
    }
    assert!(client.lock("{order}42").is_ok());
}

#[tokio::test]
async fn zero_and_overflowing_durations_are_refused() {
    let server = server().await;
    let client = client(&server).await;
    bounded(LIMIT, async {
        let lock = client.lock("durations").unwrap();
        for lease in [Duration::ZERO, Duration::from_micros(10), Duration::MAX] {
            let err = lock.with_lease(lease).try_lock().await.unwrap_err();
            assert!(
                matches!(err, Error::InvalidDuration { what: "lease", .. }),
                "{err}"
            );
            let err = lock.with_lease(lease).lock().await.unwrap_err();
            assert!(matches!(err, Error::InvalidDuration { .. }), "{err}");
        }
        let err = lock.try_lock_for(Duration::MAX).await.unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidDuration {
                    what: "wait timeout",
                    ..
                }
            ),
            "{err}"
        );
        assert!(!lock.is_locked().await.unwrap(), "nothing was written");

        for watchdog in [Duration::ZERO, Duration::MAX] {
            let err = Client::builder()
                .watchdog_timeout(watchdog)
                .connect(&server.url())
                .await
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidDuration {
                        what: "watchdog timeout",
                        ..
                    }
                ),
                "{err}"
            );
        }
    })
    .await;
}

#[tokio::test]
async fn invalid_urls_are_refused_without_echoing_passwords() {
    bounded(LIMIT, async {
        for url in [
            "",
            "not a url",
            "http://127.0.0.1/",
            "redis://127.0.0.1:99999/",
        ] {
            let err = Client::connect(url).await.unwrap_err();
            assert!(matches!(err, Error::InvalidUrl { .. }), "{url:?}: {err}");
        }
        let err = Client::connect("ftp://user:hunter2@host/")
            .await
            .unwrap_err();
        assert!(!err.to_string().contains("hunter2"), "{err}");
    })
    .await;
}

#[tokio::test]
async fn an_unreachable_server_is_a_connect_error() {
    let port = distlock_testkit::pick_free_port().unwrap();
    let err = bounded(
        LIMIT,
        Client::connect(&format!("redis://127.0.0.1:{port}/")),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err}");
}

#[tokio::test]
async fn a_server_that_is_not_redis_is_named_as_such() {
    // An HTTP server answers the handshake with a status line.
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let http_port = http.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut stream in http.incoming().flatten() {
            let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        }
    });
    let err = bounded(
        LIMIT,
        Client::connect(&format!("redis://127.0.0.1:{http_port}/")),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::NotRedis { .. }), "{err}");

    // A server that accepts and never answers.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let _keep = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let err = bounded(
        LIMIT,
        Client::builder()
            .connection_timeout(Duration::from_millis(300))
            .connect(&format!("redis://127.0.0.1:{silent_port}/")),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, Error::ConnectTimeout { .. }), "{err}");
}

#[tokio::test]
async fn a_foreign_key_at_the_lock_name_is_an_error_not_a_panic() {
    let server = server().await;
    let client = client(&server).await;
    let mut conn = raw(&server).await;
    bounded(LIMIT, async {
        let _: () = conn.set("taken-by-a-string", "x").await.unwrap();
        let lock = client.lock("taken-by-a-string").unwrap();
        assert!(matches!(lock.try_lock().await, Err(Error::Redis(_))));
        let value: String = conn.get("taken-by-a-string").await.unwrap();
        assert_eq!(value, "x", "the foreign key is untouched");
    })
    .await;
}

#[tokio::test]
async fn an_unlock_latch_shorter_than_the_release_retry_window_is_refused() {
    let server = server().await;
    // A release is tried three times, each waiting up to the response timeout.
    let err = Client::builder()
        .response_timeout(Duration::from_secs(2))
        .unlock_latch_ttl(Duration::from_secs(1))
        .connect(&server.url())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidConfig {
                what: "unlock latch ttl",
                ..
            }
        ),
        "{err}"
    );
}
