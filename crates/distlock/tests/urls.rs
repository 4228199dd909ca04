//! Connection URLs for every deployment: typed errors (never a panic, a hang, or a
//! transient-looking error for a typo), no password echoed back, credentials decoded as
//! in a `redis://` URL, and connects bounded by the connection timeout.

mod common;

use std::time::{Duration, Instant};

use common::bounded;
use distlock::{Client, Error};
use distlock_testkit::RedisServer;

const LIMIT: Duration = Duration::from_secs(30);

/// A single Sentinel watching `master_port` as `mymaster`, with `extra` configuration.
async fn sentinel_for(master_port: u16, extra: &str) -> RedisServer {
    let config = format!(
        "sentinel monitor mymaster 127.0.0.1 {master_port} 1\n\
         sentinel down-after-milliseconds mymaster 1000\n{extra}"
    );
    RedisServer::start_sentinel(&config)
        .await
        .expect("sentinel")
}

/// A sentinel password given in the query is masked in errors like one in the userinfo.
/// (Review 9: it was echoed in clear.)
#[tokio::test]
async fn a_sentinel_password_in_the_query_is_never_echoed() {
    for url in [
        "redis+sentinel://h1:26379/mymaster/notanumber?sentinel_password=hunter2",
        "redis+sentinel://app:pw@h1:26379/mymaster/x?sentinel_password=hunter2",
        "redis+sentinel://h1:26379/mymaster?sentinel_password=hunter2&bogus=1",
    ] {
        let err = Client::connect(url).await.expect_err(url);
        let shown = format!("{err} / {err:?}");
        assert!(matches!(err, Error::InvalidUrl { .. }), "{url}: {shown}");
        assert!(!shown.contains("hunter2"), "password leaked: {shown}");
    }
}

/// Odd URLs of every scheme come back as typed errors, quickly, without panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn odd_urls_give_typed_errors_quickly() {
    let huge_hosts = std::iter::repeat_n("h", 20_000)
        .collect::<Vec<_>>()
        .join(",");
    let long_name = "m".repeat(1 << 20);
    let urls: Vec<String> = vec![
        "redis+sentinel://".into(),
        "redis+sentinel:///".into(),
        "redis+sentinel:///mymaster".into(),
        "redis+sentinel://h:1".into(),
        "redis+sentinel://h:1/".into(),
        "redis+sentinel://h:1//".into(),
        "redis+sentinel://h:1/m/-1".into(),
        "redis+sentinel://h:1/m/99999999999999999999999".into(),
        "redis+sentinel://h:99999/m".into(),
        "redis+sentinel://ü:1/mÿmaster".into(),
        "redis+sentinel://[::1/m".into(),
        "redis+sentinel://@/m".into(),
        "redis+sentinel://h:1/m?".into(),
        "redis+sentinel://h:1/m?sentinel_password".into(),
        "redis+sentinel://h:1,/m".into(),
        format!("redis+sentinel://127.0.0.1:1/{long_name}"),
        format!("redis+sentinel://{huge_hosts}/m"),
        "redis+cluster://".into(),
        "redis+cluster:///".into(),
        "redis+cluster://,".into(),
        "redis+cluster://h:99999".into(),
        "redis+cluster://ü:1".into(),
        "redis+cluster://[::1".into(),
        "redis+cluster://h:1/notadb".into(),
        "redis+cluster://@".into(),
        "rediss+cluster://:@".into(),
        "redis+cluster://127.0.0.1:1?".into(),
        "redis+clusterx://h:1".into(),
        "redis+sentinel+cluster://h:1/m".into(),
    ];
    for url in urls {
        let shown: String = url.chars().take(80).collect();
        let started = Instant::now();
        let outcome = tokio::spawn({
            let url = url.clone();
            async move {
                tokio::time::timeout(
                    Duration::from_secs(10),
                    Client::builder()
                        .connection_timeout(Duration::from_millis(300))
                        .connect(&url),
                )
                .await
            }
        })
        .await;
        let outcome = match outcome {
            Ok(outcome) => outcome,
            Err(panic) => panic!("{shown}: panicked: {panic}"),
        };
        let outcome = outcome.unwrap_or_else(|_| panic!("{shown}: hung for 10 s"));
        let err = match outcome {
            Ok(_) => panic!("{shown}: connected?"),
            Err(err) => err,
        };
        assert!(
            matches!(
                err,
                Error::InvalidUrl { .. } | Error::Connect { .. } | Error::ConnectTimeout { .. }
            ),
            "{shown}: {err:?}"
        );
        eprintln!(
            "{shown} -> {:?} in {:?}",
            err.to_string().chars().take(160).collect::<String>(),
            started.elapsed()
        );
    }
}

/// A sentinel host that does not parse is a bad URL, not a connection error that retry
/// loops would retry forever.
#[tokio::test]
async fn unparsable_sentinel_hosts_are_invalid_urls() {
    for url in ["redis+sentinel://h:99999/m", "redis+sentinel://[::1/m"] {
        let err = Client::connect(url).await.expect_err(url);
        assert!(
            matches!(err, Error::InvalidUrl { .. }) && !err.is_connection_error(),
            "{url}: {err:?} (is_connection_error={})",
            err.is_connection_error()
        );
    }
}

/// A cluster URL naming a standalone server: a typed error, quickly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_url_at_a_standalone_server_is_a_typed_error() {
    let server = RedisServer::start().await.expect("start");
    let url = format!("redis+cluster://127.0.0.1:{}", server.port());
    let started = Instant::now();
    let outcome = bounded(LIMIT, Client::connect(&url)).await;
    let err = outcome.expect_err("a standalone server is not a cluster");
    eprintln!("{err} in {:?}", started.elapsed());
    assert!(matches!(err, Error::Connect { .. }), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// The connection timeout bounds a whole cluster connect, however many seeds are silent.
/// (Review 9: seeds were probed one by one, N silent seeds taking N timeouts.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_connect_is_bounded_by_the_connection_timeout() {
    // Listeners that never accept: the TCP handshake completes (backlog), nothing answers.
    let mut listeners = Vec::new();
    for _ in 0..5 {
        listeners.push(std::net::TcpListener::bind("127.0.0.1:0").expect("bind"));
    }
    let hosts: Vec<String> = listeners
        .iter()
        .map(|listener| listener.local_addr().expect("addr").to_string())
        .collect();
    let url = format!("redis+cluster://{}", hosts.join(","));
    let timeout = Duration::from_millis(400);
    let started = Instant::now();
    let outcome = bounded(
        LIMIT,
        Client::builder().connection_timeout(timeout).connect(&url),
    )
    .await;
    let elapsed = started.elapsed();
    eprintln!("{:?} after {elapsed:?}", outcome.as_ref().err());
    assert!(outcome.is_err());
    assert!(
        elapsed < timeout * 2,
        "connect with a {timeout:?} connection timeout took {elapsed:?}"
    );
}

/// A sentinel URL whose master name is unknown to the sentinels: a typed error, quickly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_name_the_sentinels_do_not_know_is_a_typed_error() {
    let master = RedisServer::start().await.expect("start");
    let sentinel = sentinel_for(master.port(), "").await;
    let url = format!("redis+sentinel://127.0.0.1:{}/notmymaster", sentinel.port());
    let started = Instant::now();
    let err = bounded(LIMIT, Client::connect(&url))
        .await
        .expect_err("no such master");
    eprintln!("{err} after {:?}", started.elapsed());
    assert!(matches!(
        err,
        Error::Connect { .. } | Error::ConnectTimeout { .. }
    ));
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// The data nodes' password in a sentinel URL is percent-decoded, as in a redis:// URL,
/// so a password with `@` or `/` can be given. (Review 9: it was taken verbatim.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_url_password_is_percent_decoded() {
    let master = RedisServer::start_with_args(&["--requirepass", "p@ss/word"])
        .await
        .expect("start");
    // The same password, percent-encoded, works in a plain redis:// URL.
    let plain = format!("redis://:p%40ss%2Fword@127.0.0.1:{}", master.port());
    let direct = bounded(LIMIT, Client::connect(&plain)).await;
    assert!(direct.is_ok(), "redis:// form: {:?}", direct.err());
    let sentinel = sentinel_for(master.port(), "sentinel auth-pass mymaster p@ss/word\n").await;
    let url = format!(
        "redis+sentinel://:p%40ss%2Fword@127.0.0.1:{}/mymaster",
        sentinel.port()
    );
    let outcome = bounded(LIMIT, Client::connect(&url)).await;
    assert!(outcome.is_ok(), "sentinel form: {:?}", outcome.err());
}
