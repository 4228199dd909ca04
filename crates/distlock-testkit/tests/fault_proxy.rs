//! Tests of `FaultProxy` in front of a real `redis-server`.

use std::error::Error;
use std::future::Future;
use std::time::{Duration, Instant};

use distlock_testkit::{Direction, FaultProxy, RedisServer};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, RedisResult};

type TestResult = Result<(), Box<dyn Error>>;

/// Upper bound for any single test, so a wedged proxy fails the test instead
/// of hanging the suite.
const TEST_LIMIT: Duration = Duration::from_secs(30);
/// The client's response timeout: far above a local round trip, far below
/// anything a test should wait for.
const RESPONSE_TIMEOUT: Duration = Duration::from_millis(300);
/// What "fails fast" means: a cut must be noticed well before any timeout.
const FAST: Duration = Duration::from_secs(1);
/// Upper bound for a wait on the proxy's connection count.
const COUNT_WAIT: Duration = Duration::from_secs(5);

async fn bounded(test: impl Future<Output = TestResult>) -> TestResult {
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .map_err(|_| format!("test did not finish within {TEST_LIMIT:?}"))?
}

fn config() -> AsyncConnectionConfig {
    AsyncConnectionConfig::new()
        .set_connection_timeout(Some(RESPONSE_TIMEOUT))
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
}

async fn connect(proxy: &FaultProxy) -> RedisResult<MultiplexedConnection> {
    redis::Client::open(proxy.url())?
        .get_multiplexed_async_connection_with_config(&config())
        .await
}

async fn ping(conn: &mut MultiplexedConnection) -> RedisResult<String> {
    redis::cmd("PING").query_async(conn).await
}

/// Connects and pings, so a failure in either step counts.
async fn connect_and_ping(proxy: &FaultProxy) -> RedisResult<String> {
    ping(&mut connect(proxy).await?).await
}

async fn wait_for_connections(proxy: &FaultProxy, count: usize) -> TestResult {
    tokio::time::timeout(COUNT_WAIT, proxy.wait_for_connections(count))
        .await
        .map_err(|_| {
            format!(
                "proxy did not reach {count} connections within {COUNT_WAIT:?}, has {}",
                proxy.connections()
            )
        })?;
    Ok(())
}

#[tokio::test]
async fn forwards_commands_and_counts_connections() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let proxy = FaultProxy::in_front_of(&server).await?;
        assert_eq!(proxy.url(), format!("redis://127.0.0.1:{}/", proxy.port()));
        assert_ne!(proxy.port(), server.port());
        assert_eq!(proxy.connections(), 0);

        let mut first = connect(&proxy).await?;
        assert_eq!(ping(&mut first).await?, "PONG");
        let () = redis::cmd("SET")
            .arg("k")
            .arg("through the proxy")
            .query_async(&mut first)
            .await?;
        // The write reached the real server.
        let mut direct = server.connection().await?;
        let value: String = redis::cmd("GET").arg("k").query_async(&mut direct).await?;
        assert_eq!(value, "through the proxy");
        // A completed round trip means the proxy has accepted the connection.
        assert_eq!(proxy.connections(), 1);

        let mut second = connect(&proxy).await?;
        assert_eq!(ping(&mut second).await?, "PONG");
        assert_eq!(proxy.connections(), 2);

        drop(first);
        wait_for_connections(&proxy, 1).await?;
        drop(second);
        wait_for_connections(&proxy, 0).await?;
        Ok(())
    })
    .await
}

#[tokio::test]
async fn delay_adds_latency_to_open_connections_in_order() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let proxy = FaultProxy::in_front_of(&server).await?;
        let client = redis::Client::open(proxy.url())?;
        // Opened before the delay is set: the delay applies to it anyway.
        let mut conn = client
            .get_multiplexed_async_connection_with_config(
                &AsyncConnectionConfig::new().set_response_timeout(Some(Duration::from_secs(5))),
            )
            .await?;
        assert_eq!(ping(&mut conn).await?, "PONG");

        // One way only: the round trip is one delay longer.
        proxy.set_delay_in(Direction::ToClient, Duration::from_millis(100));
        let started = Instant::now();
        assert_eq!(ping(&mut conn).await?, "PONG");
        let one_way = started.elapsed();
        assert!(one_way >= Duration::from_millis(100), "{one_way:?}");

        // Both ways: two delays per round trip.
        proxy.set_delay(Duration::from_millis(100));
        let started = Instant::now();
        assert_eq!(ping(&mut conn).await?, "PONG");
        let both_ways = started.elapsed();
        assert!(both_ways >= Duration::from_millis(200), "{both_ways:?}");

        // Concurrent commands on one multiplexed connection rely on replies
        // arriving in request order; a reordering proxy would swap them. They
        // are also delayed together, not one after another.
        let started = Instant::now();
        let mut echoes = tokio::task::JoinSet::new();
        for i in 0..20 {
            let mut conn = conn.clone();
            echoes.spawn(async move {
                let reply: String = redis::cmd("ECHO")
                    .arg(format!("echo {i}"))
                    .query_async(&mut conn)
                    .await?;
                RedisResult::Ok((i, reply))
            });
        }
        while let Some(joined) = echoes.join_next().await {
            let (i, reply) = joined??;
            assert_eq!(reply, format!("echo {i}"));
        }
        let concurrent = started.elapsed();
        assert!(
            concurrent >= Duration::from_millis(200) && concurrent < Duration::from_secs(2),
            "20 concurrent echoes took {concurrent:?}: delays should overlap"
        );

        proxy.set_delay(Duration::ZERO);
        let started = Instant::now();
        assert_eq!(ping(&mut conn).await?, "PONG");
        let undelayed = started.elapsed();
        assert!(undelayed < Duration::from_millis(100), "{undelayed:?}");
        Ok(())
    })
    .await
}

// On the multi-threaded runtime, so both runtime flavours are covered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_fails_fast_and_heal_restores() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let proxy = FaultProxy::in_front_of(&server).await?;
        let mut conn = connect(&proxy).await?;
        assert_eq!(ping(&mut conn).await?, "PONG");
        assert_eq!(proxy.connections(), 1);

        proxy.cut().await;
        // `cut` returns once everything is closed.
        assert_eq!(proxy.connections(), 0);

        let started = Instant::now();
        let result = ping(&mut conn).await;
        let failed_after = started.elapsed();
        assert!(result.is_err(), "PING on a cut connection: {result:?}");
        assert!(failed_after < FAST, "cut noticed after {failed_after:?}");
        // Failing fast means a closed socket, not the response timeout.
        assert!(
            !result.as_ref().is_err_and(|e| e.is_timeout()),
            "{result:?}"
        );

        let started = Instant::now();
        let result = connect_and_ping(&proxy).await;
        let failed_after = started.elapsed();
        assert!(result.is_err(), "new connection during a cut: {result:?}");
        assert!(
            failed_after < FAST,
            "refusal noticed after {failed_after:?}"
        );
        assert_eq!(proxy.connections(), 0);

        proxy.heal();
        assert_eq!(connect_and_ping(&proxy).await?, "PONG");
        // The old connection stays broken; clients must reconnect.
        assert!(ping(&mut conn).await.is_err());
        Ok(())
    })
    .await
}

#[tokio::test]
async fn blackhole_swallows_requests_until_heal() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let proxy = FaultProxy::in_front_of(&server).await?;
        let mut conn = connect(&proxy).await?;
        assert_eq!(ping(&mut conn).await?, "PONG");

        proxy.blackhole();
        let started = Instant::now();
        let result: RedisResult<()> = redis::cmd("SET")
            .arg("k")
            .arg("lost")
            .query_async(&mut conn)
            .await;
        let waited = started.elapsed();
        assert!(
            result.as_ref().is_err_and(|e| e.is_timeout()),
            "SET through a blackhole: {result:?}"
        );
        assert!(waited >= RESPONSE_TIMEOUT, "gave up after {waited:?}");
        // The connection looks alive: it is still open.
        assert_eq!(proxy.connections(), 1);

        // New connections are accepted but get no answer either.
        let result = connect_and_ping(&proxy).await;
        assert!(
            result.as_ref().is_err_and(|e| e.is_timeout()),
            "new connection through a blackhole: {result:?}"
        );

        // Nothing reached the server.
        let mut direct = server.connection().await?;
        let value: Option<String> = redis::cmd("GET").arg("k").query_async(&mut direct).await?;
        assert_eq!(value, None);

        // heal closes the blackholed connections (their streams lost bytes)
        // and forwards new ones.
        proxy.heal();
        wait_for_connections(&proxy, 0).await?;
        assert_eq!(connect_and_ping(&proxy).await?, "PONG");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn delay_to_client_delivers_request_before_reply() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let proxy = FaultProxy::in_front_of(&server).await?;
        let mut conn = connect(&proxy).await?;
        // The reply arrives after the client gave up, but the write happened:
        // the situation a lock client meets when an acknowledgement is late.
        proxy.set_delay_in(Direction::ToClient, RESPONSE_TIMEOUT * 3);
        let result: RedisResult<()> = redis::cmd("SET")
            .arg("k")
            .arg("applied")
            .query_async(&mut conn)
            .await;
        assert!(result.as_ref().is_err_and(|e| e.is_timeout()), "{result:?}");
        let mut direct = server.connection().await?;
        let value: Option<String> = redis::cmd("GET").arg("k").query_async(&mut direct).await?;
        assert_eq!(value.as_deref(), Some("applied"));
        Ok(())
    })
    .await
}

#[tokio::test]
async fn shutdown_closes_listener_and_connections() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let proxy = FaultProxy::in_front_of(&server).await?;
        let port = proxy.port();
        let mut conn = connect(&proxy).await?;
        assert_eq!(ping(&mut conn).await?, "PONG");

        proxy.shutdown().await;
        let started = Instant::now();
        let result = ping(&mut conn).await;
        assert!(
            result.as_ref().is_err_and(|e| !e.is_timeout()),
            "PING after shutdown: {result:?}"
        );
        assert!(started.elapsed() < FAST, "{:?}", started.elapsed());
        let refused = tokio::net::TcpStream::connect(("127.0.0.1", port)).await;
        assert!(refused.is_err(), "listener still open: {refused:?}");
        Ok(())
    })
    .await
}

// On the multi-threaded runtime, so both runtime flavours are covered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_stops_the_proxy() -> TestResult {
    bounded(async {
        let server = RedisServer::start().await?;
        let proxy = FaultProxy::in_front_of(&server).await?;
        let mut conn = connect(&proxy).await?;
        assert_eq!(ping(&mut conn).await?, "PONG");

        drop(proxy);
        // The aborted tasks close the sockets; the client sees EOF rather
        // than waiting for its response timeout.
        let started = Instant::now();
        let result = ping(&mut conn).await;
        assert!(
            result.as_ref().is_err_and(|e| !e.is_timeout()),
            "PING after drop: {result:?}"
        );
        assert!(started.elapsed() < FAST, "{:?}", started.elapsed());
        Ok(())
    })
    .await
}
