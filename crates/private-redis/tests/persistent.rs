//! A persistent private Redis keeps its data across crashes and restarts, has one owner per
//! directory, and cleans up after an owner that died.

use std::future::Future;
use std::time::Duration;

use private_redis::{Error, PrivateRedis};

async fn bounded<T>(future: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), future)
        .await
        .expect("test step did not finish within 60 s")
}

/// A persistent server on `dir`, started.
async fn start(dir: impl AsRef<std::path::Path>) -> PrivateRedis {
    PrivateRedis::persistent(dir)
        .start()
        .await
        .expect("start a persistent server")
}

async fn connect(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

async fn get(url: &str, key: &str) -> Option<String> {
    let mut conn = connect(url).await;
    redis::cmd("GET")
        .arg(key)
        .query_async(&mut conn)
        .await
        .expect("GET")
}

async fn set(url: &str, key: &str, value: &str) {
    let mut conn = connect(url).await;
    let () = redis::cmd("SET")
        .arg(key)
        .arg(value)
        .query_async(&mut conn)
        .await
        .expect("SET");
}

#[tokio::test]
async fn a_write_survives_a_kill_of_the_server() {
    bounded(async {
        let dir = tempfile::tempdir().expect("dir");
        let mut redis = start(dir.path()).await;
        set(&redis.url(), "order:1", "sold").await;
        // SIGKILL: no chance to flush anything after the reply was sent.
        redis.restart().await.expect("restart");
        assert_eq!(get(&redis.url(), "order:1").await.as_deref(), Some("sold"));
    })
    .await;
}

#[tokio::test]
async fn a_write_survives_the_owner_dropping_the_server_and_starting_again() {
    bounded(async {
        let dir = tempfile::tempdir().expect("dir");
        let first = start(dir.path()).await;
        set(&first.url(), "order:1", "sold").await;
        drop(first);
        // The dropped server may still be shutting down: the next start waits for it.
        let second = start(dir.path()).await;
        assert_eq!(get(&second.url(), "order:1").await.as_deref(), Some("sold"));
        second.stop().await.expect("stop");
    })
    .await;
}

#[tokio::test]
async fn a_second_owner_of_the_directory_is_refused() {
    bounded(async {
        let dir = tempfile::tempdir().expect("dir");
        let first = start(dir.path()).await;
        match PrivateRedis::persistent(dir.path()).start().await {
            Err(Error::InUse { holder, .. }) => assert_eq!(holder, Some(std::process::id())),
            other => panic!("expected InUse, got {other:?}"),
        }
        // The refusal did not disturb the first.
        set(&first.url(), "k", "v").await;
    })
    .await;
}

#[tokio::test]
async fn only_the_owner_knows_the_password() {
    bounded(async {
        let dir = tempfile::tempdir().expect("dir");
        let redis = start(dir.path()).await;
        let stranger = format!("redis://127.0.0.1:{}/", redis.port());
        let mut conn = connect(&stranger).await;
        let refused: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut conn).await;
        let err = refused.expect_err("a client without the password was served");
        assert_eq!(err.code(), Some("NOAUTH"), "{err}");
        let cmdline =
            std::fs::read(format!("/proc/{}/cmdline", redis.pid().expect("pid"))).expect("cmdline");
        let password = redis.url();
        let password = password
            .trim_start_matches("redis://:")
            .split('@')
            .next()
            .expect("password");
        assert!(
            !String::from_utf8_lossy(&cmdline).contains(password),
            "the password is on the command line, visible to every local user"
        );
    })
    .await;
}

/// An owner killed with -9 leaves its server behind when the parent-death signal could
/// not act (another thread started it, or an older build). The next owner must stop it
/// before starting its own on the same files, keeping what it had stored.
#[tokio::test]
async fn a_server_left_by_a_dead_owner_is_stopped_and_its_data_kept() {
    bounded(async {
        let dir = tempfile::tempdir().expect("dir");
        let dir_path = std::fs::canonicalize(dir.path()).expect("canonical");
        let port = private_redis::pick_free_port().expect("port");
        let mut orphan = tokio::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .arg("--dir")
            .arg(&dir_path)
            .args(["--appendonly", "yes", "--save", "", "--daemonize", "no"])
            .arg("--pidfile")
            .arg(dir_path.join("redis-server.pid"))
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the orphan");
        let orphan_url = format!("redis://127.0.0.1:{port}/");
        // Ready once it answers and has written its pid file.
        let mut answered = false;
        for _ in 0..500 {
            if let Ok(client) = redis::Client::open(orphan_url.as_str()) {
                if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
                    let pong: redis::RedisResult<String> =
                        redis::cmd("PING").query_async(&mut conn).await;
                    if pong.is_ok() && dir_path.join("redis-server.pid").exists() {
                        answered = true;
                        break;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(answered, "the orphan never came up");
        set(&orphan_url, "order:7", "sold").await;

        let redis = start(&dir_path).await;
        let exited = tokio::time::timeout(Duration::from_secs(5), orphan.wait()).await;
        assert!(
            matches!(exited, Ok(Ok(_))),
            "the orphan still runs beside the new server"
        );
        assert_eq!(get(&redis.url(), "order:7").await.as_deref(), Some("sold"));
    })
    .await;
}
