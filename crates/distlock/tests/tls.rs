//! TLS with a certificate from a throwaway CA: a `rediss://` server, a Sentinel
//! deployment and a cluster, all trusting the CA through the builder's certificates.

mod common;

use std::path::Path;
use std::time::Duration;

use common::bounded;
use distlock::{Client, Error};
use distlock_testkit::RedisServer;
use tokio::time::Instant;

const LIMIT: Duration = Duration::from_secs(30);

#[tokio::test]
async fn locks_work_over_tls_with_a_trusted_ca_and_fail_without_it() {
    let dir = tempfile::tempdir().unwrap();
    let certificates =
        distlock_testkit::write_test_certificates(dir.path()).expect("test certificates");
    let (server, tls_port) = certificates
        .start_server(false)
        .await
        .expect("redis-server with TLS");
    let url = format!("rediss://127.0.0.1:{tls_port}/");

    bounded(LIMIT, async {
        let certificates = redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(std::fs::read(&certificates.ca).unwrap()),
        };
        let redis_client = redis::Client::build_with_tls(url.as_str(), certificates).unwrap();
        let client = Client::builder().connect_with(redis_client).await.unwrap();
        let lock = client.lock("over-tls").unwrap();
        let held = lock.lock().await.unwrap();
        // A waiter's pub/sub connection is TLS too, and the release wakes it.
        let contender = lock.clone();
        let waiting = tokio::spawn(async move {
            let guard = contender.try_lock_for(Duration::from_secs(5)).await;
            (Instant::now(), guard)
        });
        // The plain port is open too, for looking.
        let plain = server.connection().await.unwrap();
        common::until_subscribers(&plain, "redisson_lock__channel:{over-tls}", 1).await;
        held.release().await.unwrap();
        let released_at = Instant::now();
        let (acquired_at, next) = waiting.await.unwrap();
        let next = next.unwrap().expect("woken over TLS");
        let handoff = acquired_at.duration_since(released_at);
        assert!(
            handoff < Duration::from_millis(200),
            "no wake-up: {handoff:?}"
        );
        next.release().await.unwrap();

        // The system trust store does not know the throwaway CA: a clear connect error.
        let err = Client::connect(&url).await.unwrap_err();
        assert!(
            matches!(err, Error::Connect { .. } | Error::NotRedis { .. }),
            "{err}"
        );
    })
    .await;
}

/// The CA's certificate, as the builder takes it.
fn trust(dir: &Path) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(std::fs::read(dir.join("ca.crt")).unwrap()),
    }
}

/// A redis-server (or sentinel) configuration serving TLS on `tls_port` with the
/// throwaway certificate, as `name value` pairs.
fn tls_settings(dir: &Path, tls_port: u16) -> Vec<(&'static str, String)> {
    let path = |file: &str| dir.join(file).display().to_string();
    vec![
        ("tls-port", tls_port.to_string()),
        ("tls-cert-file", path("server.crt")),
        ("tls-key-file", path("server.key")),
        ("tls-ca-cert-file", path("ca.crt")),
        ("tls-auth-clients", "no".to_owned()),
    ]
}

fn as_args(settings: &[(&'static str, String)]) -> Vec<String> {
    settings
        .iter()
        .flat_map(|(name, value)| [format!("--{name}"), value.clone()])
        .collect()
}

/// A holder and a waiter on `name`: once the waiter's subscription (over TLS) reaches the
/// server, which `plain` (a plain-port connection to it) watches, the release wakes it.
/// Returns the handoff.
async fn handoff(
    client: &Client,
    name: &str,
    plain: &redis::aio::MultiplexedConnection,
    sharded: bool,
) -> Duration {
    let lock = client.lock(name).unwrap();
    let held = lock.lock().await.unwrap();
    let contender = lock.clone();
    let waiting = tokio::spawn(async move {
        let guard = contender.try_lock_for(Duration::from_secs(5)).await;
        (Instant::now(), guard)
    });
    let channel = format!("redisson_lock__channel:{{{name}}}");
    let count = if sharded { "SHARDNUMSUB" } else { "NUMSUB" };
    common::eventually(LIMIT, "the waiter subscribed", || {
        let (mut plain, channel) = (plain.clone(), channel.clone());
        async move {
            let (_, subscribers): (String, i64) = redis::cmd("PUBSUB")
                .arg(count)
                .arg(&channel)
                .query_async(&mut plain)
                .await
                .unwrap();
            subscribers == 1
        }
    })
    .await;
    held.release().await.unwrap();
    let released_at = Instant::now();
    let (acquired_at, next) = waiting.await.unwrap();
    next.unwrap()
        .expect("the waiter gets the lock")
        .release()
        .await
        .unwrap();
    acquired_at.saturating_duration_since(released_at)
}

/// `rediss+sentinel://` with a private CA given to the builder: the sentinels and the
/// master they name are both reached over TLS, and locks and waiters work. Without the
/// CA, connecting fails with a connect error, not a hang.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_ca_reaches_the_sentinels_and_the_master_they_name() {
    let dir = tempfile::tempdir().unwrap();
    distlock_testkit::write_test_certificates(dir.path()).expect("test certificates");
    let master_tls = distlock_testkit::pick_free_port().unwrap();
    let master_args = as_args(&tls_settings(dir.path(), master_tls));
    let master_args: Vec<&str> = master_args.iter().map(String::as_str).collect();
    let master = RedisServer::start_with_args(&master_args).await.unwrap();
    let sentinel_tls = distlock_testkit::pick_free_port().unwrap();
    let mut config: String = tls_settings(dir.path(), sentinel_tls)
        .iter()
        .map(|(name, value)| format!("{name} {value}\n"))
        .collect();
    // The sentinel reaches the master over TLS too.
    config.push_str(&format!(
        "tls-replication yes\n\
         sentinel monitor mymaster 127.0.0.1 {master_tls} 1\n\
         sentinel down-after-milliseconds mymaster 1000\n"
    ));
    let _sentinel = RedisServer::start_sentinel(&config).await.unwrap();
    let url = format!("rediss+sentinel://127.0.0.1:{sentinel_tls}/mymaster");

    bounded(LIMIT, async {
        let client = Client::builder()
            .tls_certificates(trust(dir.path()))
            .connect(&url)
            .await
            .unwrap();
        let plain = master.connection().await.unwrap();
        let took = handoff(&client, "sentinel-over-tls", &plain, false).await;
        assert!(took < Duration::from_millis(200), "no wake-up: {took:?}");
        client.shutdown().await;

        let err = Client::builder()
            .connection_timeout(Duration::from_secs(2))
            .connect(&url)
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::Connect { .. } | Error::ConnectTimeout { .. }),
            "{err}"
        );
    })
    .await;
}

/// A cluster whose nodes speak TLS among themselves and to clients
/// (`tls-cluster yes`), with a private CA given to the builder: scripts routed to the
/// slot's master and sharded pub/sub both go over TLS. The CA given to the builder reaches
/// the nodes the cluster client discovers, not only the seed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_ca_reaches_every_node_of_a_tls_cluster() {
    let dir = tempfile::tempdir().unwrap();
    distlock_testkit::write_test_certificates(dir.path()).expect("test certificates");
    let tls_port = distlock_testkit::pick_free_port().unwrap();
    let bus_port = distlock_testkit::pick_free_port().unwrap().to_string();
    let mut args = as_args(&tls_settings(dir.path(), tls_port));
    for arg in [
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-port",
        &bus_port,
        "--tls-cluster",
        "yes",
    ] {
        args.push(arg.to_owned());
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let node = RedisServer::start_with_args(&args).await.unwrap();
    let mut plain = node.connection().await.unwrap();
    let () = redis::cmd("CLUSTER")
        .arg("ADDSLOTSRANGE")
        .arg(0)
        .arg(16_383)
        .query_async(&mut plain)
        .await
        .unwrap();
    common::eventually(LIMIT, "cluster_state:ok", || {
        let mut plain = plain.clone();
        async move {
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query_async(&mut plain)
                .await
                .unwrap();
            info.contains("cluster_state:ok")
        }
    })
    .await;

    bounded(LIMIT, async {
        for url in [
            format!("rediss+cluster://127.0.0.1:{tls_port}"),
            // A node's rediss:// URL joins its cluster with the same certificates.
            format!("rediss://127.0.0.1:{tls_port}"),
        ] {
            let client = Client::builder()
                .tls_certificates(trust(dir.path()))
                .connect(&url)
                .await
                .unwrap_or_else(|err| panic!("{url}: {err}"));
            assert!(client.is_cluster(), "{url}");
            let took = handoff(&client, "cluster-over-tls", &plain, true).await;
            assert!(
                took < Duration::from_millis(200),
                "{url}: no wake-up: {took:?}"
            );
            client.shutdown().await;
        }
    })
    .await;
}

/// Certificates with a URL that has no TLS, or that hold no certificate, are typed
/// configuration errors at once, not a connection in clear or a vague failure later.
#[tokio::test]
async fn certificates_without_tls_or_without_a_certificate_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    distlock_testkit::write_test_certificates(dir.path()).expect("test certificates");
    for url in [
        "redis://127.0.0.1:1/",
        "redis+cluster://127.0.0.1:1,127.0.0.1:2",
        "redis+sentinel://127.0.0.1:1/mymaster",
    ] {
        let err = bounded(
            LIMIT,
            Client::builder()
                .tls_certificates(trust(dir.path()))
                .connect(url),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{url}: {err}");
    }
    for root in [
        b"/etc/redis/ca.crt".to_vec(),
        Vec::new(),
        vec![0x30, 0x82, 0x01],
    ] {
        let certificates = redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(root),
        };
        let err = bounded(
            LIMIT,
            Client::builder()
                .tls_certificates(certificates)
                .connect("rediss://127.0.0.1:1/"),
        )
        .await
        .unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    }
}
