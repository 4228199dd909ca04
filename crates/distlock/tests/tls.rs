//! TLS: a `rediss://` server with a certificate from a throwaway CA.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::bounded;
use distlock::{Client, Error};
use distlock_testkit::RedisServer;
use tokio::time::Instant;

const LIMIT: Duration = Duration::from_secs(30);

/// A CA and a server certificate for 127.0.0.1, made with the openssl command.
fn make_certificates(dir: &Path) {
    let run = |args: &[&str]| {
        let status = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stderr(std::process::Stdio::null())
            .status()
            .expect("openssl is installed (./dev test installs it)");
        assert!(status.success(), "openssl {args:?} failed");
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=distlock test CA",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
    ]);
    std::fs::write(dir.join("san.ext"), "subjectAltName=IP:127.0.0.1\n").expect("write san.ext");
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "server.crt",
    ]);
}

#[tokio::test]
async fn locks_work_over_tls_with_a_trusted_ca_and_fail_without_it() {
    let dir = tempfile::tempdir().unwrap();
    make_certificates(dir.path());
    let path = |file: &str| dir.path().join(file).display().to_string();
    let tls_port = distlock_testkit::pick_free_port().unwrap().to_string();
    let (cert, key, ca) = (path("server.crt"), path("server.key"), path("ca.crt"));
    let server = RedisServer::start_with_args(&[
        "--tls-port",
        &tls_port,
        "--tls-cert-file",
        &cert,
        "--tls-key-file",
        &key,
        "--tls-ca-cert-file",
        &ca,
        "--tls-auth-clients",
        "no",
    ])
    .await
    .expect("redis-server with TLS");
    let url = format!("rediss://127.0.0.1:{tls_port}/");

    bounded(LIMIT, async {
        let certificates = redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(std::fs::read(dir.path().join("ca.crt")).unwrap()),
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
