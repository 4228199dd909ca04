//! Tests of the testkit against a real `redis-server`.

use std::error::Error;
use std::future::Future;
use std::time::Duration;

use distlock_testkit::{FencedResource, RedisServer};

type TestResult = Result<(), Box<dyn Error>>;

/// Upper bound for any single test, so a wedged server fails the test
/// instead of hanging the suite.
const TEST_LIMIT: Duration = Duration::from_secs(30);
/// Long enough for a healthy local server (sub-millisecond) to answer,
/// short enough to keep the pause test quick.
const PAUSED_PING_WAIT: Duration = Duration::from_millis(300);

async fn bounded(test: impl Future<Output = TestResult>) -> TestResult {
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .map_err(|_| format!("test did not finish within {TEST_LIMIT:?}"))?
}

async fn ping(conn: &mut redis::aio::MultiplexedConnection) -> redis::RedisResult<String> {
    redis::cmd("PING").query_async(conn).await
}

#[tokio::test]
async fn start_serves_ping() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        assert_ne!(server.port(), 0);
        assert_eq!(
            server.url(),
            format!("redis://127.0.0.1:{}/", server.port())
        );
        assert!(server.pid().is_some());
        let mut conn = server.connection().await?;
        assert_eq!(ping(&mut conn).await?, "PONG");
        assert!(
            server
                .recent_log()
                .iter()
                .any(|line| line.contains("Ready to accept connections")),
            "log: {:?}",
            server.recent_log()
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn concurrent_servers_are_isolated() -> TestResult {
    bounded(async {
        let (a, b) = tokio::try_join!(RedisServer::start(), RedisServer::start())?;
        assert_ne!(a.port(), b.port());
        let mut conn_a = a.connection().await?;
        let mut conn_b = b.connection().await?;
        let () = redis::cmd("SET")
            .arg("k")
            .arg("a")
            .query_async(&mut conn_a)
            .await?;
        let seen: Option<String> = redis::cmd("GET").arg("k").query_async(&mut conn_b).await?;
        assert_eq!(seen, None);
        Ok(())
    })
    .await
}

#[tokio::test]
async fn extra_args_are_applied() -> TestResult {
    bounded(async {
        let server = RedisServer::start_with_args(&["--maxmemory", "12mb"]).await?;
        let mut conn = server.connection().await?;
        let config: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg("maxmemory")
            .query_async(&mut conn)
            .await?;
        assert_eq!(
            config,
            vec!["maxmemory".to_owned(), (12 * 1024 * 1024).to_string()]
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn invalid_args_report_server_output() -> TestResult {
    bounded(async {
        match RedisServer::start_with_args(&["--no-such-option", "1"]).await {
            Ok(_) => Err("redis-server accepted an unknown option".into()),
            Err(err) => {
                let message = err.to_string();
                assert!(message.contains("exited before it was ready"), "{message}");
                assert!(message.contains("no-such-option"), "{message}");
                Ok(())
            }
        }
    })
    .await
}

#[tokio::test]
async fn pause_stops_answers_and_resume_restores_them() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let mut conn = server.connection().await?;
        assert_eq!(ping(&mut conn).await?, "PONG");

        server.pause()?;
        let while_paused = tokio::time::timeout(PAUSED_PING_WAIT, ping(&mut conn)).await;
        assert!(
            while_paused.is_err(),
            "paused server answered: {while_paused:?}"
        );

        server.resume()?;
        let after_resume = tokio::time::timeout(Duration::from_secs(5), ping(&mut conn)).await??;
        assert_eq!(after_resume, "PONG");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn dropping_a_paused_server_kills_it() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let port = server.port();
        server.pause()?;
        drop(server);
        wait_until_refused(port).await
    })
    .await
}

#[tokio::test]
async fn restart_loses_data_but_keeps_the_port() -> TestResult {
    bounded(async {
        let mut server = RedisServer::start().await?;
        let port = server.port();
        let old_pid = server.pid();
        let mut conn = server.connection().await?;
        let () = redis::cmd("SET")
            .arg("survivor")
            .arg("1")
            .query_async(&mut conn)
            .await?;

        server.restart().await?;

        assert_eq!(server.port(), port);
        assert!(server.pid().is_some());
        assert_ne!(server.pid(), old_pid);
        let mut conn = server.connection().await?;
        assert_eq!(ping(&mut conn).await?, "PONG");
        let value: Option<String> = redis::cmd("GET")
            .arg("survivor")
            .query_async(&mut conn)
            .await?;
        assert_eq!(value, None, "data survived a restart without persistence");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn restart_of_a_paused_server_works() -> TestResult {
    bounded(async {
        let mut server = RedisServer::start().await?;
        server.pause()?;
        server.restart().await?;
        let mut conn = server.connection().await?;
        assert_eq!(ping(&mut conn).await?, "PONG");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn kill_makes_the_port_refuse_connections() -> TestResult {
    bounded(async {
        let mut server = RedisServer::start().await?;
        let port = server.port();
        server.kill().await?;
        assert_eq!(server.pid(), None);
        match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            Ok(_) => return Err(format!("port {port} still accepts connections").into()),
            Err(err) => assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused),
        }
        // Signals need a process; these must fail cleanly, not panic.
        assert!(server.pause().is_err());
        // Killing twice is allowed.
        server.kill().await?;
        Ok(())
    })
    .await
}

#[tokio::test]
async fn fenced_resource_rejects_stale_tokens() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let resource = FencedResource::new(server.connection().await?, "fenced:doc");
        assert_eq!(resource.highest_token().await?, None);
        assert_eq!(resource.value().await?, None);
        assert_eq!(resource.rejected().await?, 0);

        assert!(resource.write(5, "five").await?);
        assert!(resource.write(5, "five again").await?);
        assert!(resource.write(7, "seven").await?);
        assert!(!resource.write(6, "six").await?);

        assert_eq!(resource.rejected().await?, 1);
        assert_eq!(resource.highest_token().await?, Some(7));
        assert_eq!(resource.value().await?.as_deref(), Some("seven"));
        Ok(())
    })
    .await
}

#[tokio::test]
async fn fenced_resource_compares_tokens_beyond_f64_precision() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let resource = FencedResource::new(server.connection().await?, "fenced:big");
        // 2^53 + 1 and 2^53 are equal as doubles; the script must still
        // tell them apart.
        let big = (1u64 << 53) + 1;
        assert!(resource.write(big, "new").await?);
        assert!(!resource.write(big - 1, "stale").await?);
        assert!(resource.write(u64::MAX, "max").await?);
        assert!(!resource.write(9, "short").await?);
        assert_eq!(resource.highest_token().await?, Some(u64::MAX));
        assert_eq!(resource.rejected().await?, 2);
        Ok(())
    })
    .await
}

#[tokio::test]
async fn fenced_resource_survives_script_cache_flush() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let mut conn = server.connection().await?;
        let resource = FencedResource::new(conn.clone(), "fenced:flush");
        assert!(resource.write(1, "a").await?);
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut conn)
            .await?;
        assert!(resource.write(2, "b").await?);
        assert_eq!(resource.value().await?.as_deref(), Some("b"));
        Ok(())
    })
    .await
}

#[tokio::test]
async fn commandstats_count_script_calls() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let resource = FencedResource::new(server.connection().await?, "fenced:stats");
        for token in 1..=3 {
            assert!(resource.write(token, "v").await?);
        }
        let stats = server.info_commandstats().await?;
        let scripted =
            stats.get("evalsha").copied().unwrap_or(0) + stats.get("eval").copied().unwrap_or(0);
        assert!(scripted >= 3, "stats: {stats:?}");
        Ok(())
    })
    .await
}

/// The kernel refuses connections as soon as the listening socket is gone,
/// but process teardown after SIGKILL is asynchronous, so poll briefly.
async fn wait_until_refused(port: u16) -> TestResult {
    for _ in 0..100 {
        match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionRefused => return Ok(()),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    Err(format!("port {port} still accepts connections").into())
}
