//! Mutual exclusion under contention, between tasks and between OS processes.
//!
//! Every critical section records its interval on the machine-wide monotonic clock,
//! does a read-modify-write of a Redis counter, and writes through a fenced resource.
//! The checker then counts overlapping holds and non-increasing tokens, the counter
//! counts lost updates, and the fenced resource counts stale writes: all must be zero.

mod common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use common::{bounded, raw, server};
use distlock::Client;
use distlock_testkit::{read_jsonl, ExclusionChecker, FencedResource};
use redis::AsyncCommands;

const LOCK: &str = "contended";
const COUNTER: &str = "contended:counter";
const FENCED: &str = "contended:resource";

/// One contender: `rounds` critical sections, each recorded in `checker`.
async fn contend(
    client: Client,
    server_url: String,
    checker: ExclusionChecker,
    label: String,
    rounds: usize,
) {
    let redis_client = redis::Client::open(server_url).unwrap();
    let mut conn = redis_client
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let fenced = FencedResource::new(conn.clone(), FENCED);
    let lock = client.lock(LOCK).unwrap();
    for _ in 0..rounds {
        let guard = lock.lock().await.unwrap();
        let hold = checker.enter(guard.fencing_token(), label.clone());
        let seen: i64 = conn.get(COUNTER).await.unwrap_or(0);
        tokio::task::yield_now().await;
        let _: () = conn.set(COUNTER, seen + 1).await.unwrap();
        assert!(
            fenced.write(guard.fencing_token(), &label).await.unwrap(),
            "a current holder's write was refused"
        );
        hold.finish();
        guard.release().await.unwrap();
    }
}

async fn run_contenders(
    url: &str,
    checker: &ExclusionChecker,
    process: &str,
    tasks: usize,
    rounds: usize,
) {
    let client = Client::connect(url).await.unwrap();
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            tokio::spawn(contend(
                client.clone(),
                url.to_owned(),
                checker.clone(),
                format!("{process}/task{task}"),
                rounds,
            ))
        })
        .collect();
    for handle in handles {
        handle.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_of_one_process_never_overlap_and_lose_no_update() {
    let server = server().await;
    let mut conn = raw(&server).await;
    let checker = ExclusionChecker::new();
    let (tasks, rounds) = (8, 250);
    bounded(
        Duration::from_secs(120),
        run_contenders(&server.url(), &checker, "p0", tasks, rounds),
    )
    .await;
    let report = checker.report();
    assert_eq!(report.holds, tasks * rounds);
    assert!(report.is_clean(), "{report}");
    let counter: usize = conn.get(COUNTER).await.unwrap();
    assert_eq!(counter, tasks * rounds, "lost updates");
    let fenced = FencedResource::new(conn, FENCED);
    assert_eq!(fenced.rejected().await.unwrap(), 0);
}

/// Entry point of the child processes of the test below; skipped in a normal run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run as a child process by separate_processes_never_overlap"]
async fn child_contender() {
    let (Ok(url), Ok(out), Ok(name)) = (
        std::env::var("DISTLOCK_CHILD_URL"),
        std::env::var("DISTLOCK_CHILD_OUT"),
        std::env::var("DISTLOCK_CHILD_NAME"),
    ) else {
        panic!("child_contender runs only as a child of separate_processes_never_overlap");
    };
    let checker = ExclusionChecker::new();
    run_contenders(&url, &checker, &name, CHILD_TASKS, ROUNDS).await;
    checker.write_jsonl(out).unwrap();
}

const CHILD_TASKS: usize = 4;
const ROUNDS: usize = 250;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_processes_never_overlap() {
    let server = server().await;
    let mut conn = raw(&server).await;
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let outputs: Vec<PathBuf> = (1..=2)
        .map(|n| dir.path().join(format!("p{n}.jsonl")))
        .collect();
    let children: Vec<_> = outputs
        .iter()
        .enumerate()
        .map(|(n, out)| {
            tokio::process::Command::new(&exe)
                .args([
                    "--exact",
                    "child_contender",
                    "--ignored",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env("DISTLOCK_CHILD_URL", server.url())
                .env("DISTLOCK_CHILD_OUT", out)
                .env("DISTLOCK_CHILD_NAME", format!("p{}", n + 1))
                .stdout(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .unwrap()
        })
        .collect();
    let checker = ExclusionChecker::new();
    let url = server.url();
    bounded(Duration::from_secs(180), async {
        let parent = run_contenders(&url, &checker, "p0", CHILD_TASKS, ROUNDS);
        let children = futures_util::future::join_all(
            children
                .into_iter()
                .map(|mut child| async move { child.wait().await.unwrap() }),
        );
        let ((), statuses) = tokio::join!(parent, children);
        for status in statuses {
            assert!(status.success(), "a child process failed: {status}");
        }
    })
    .await;
    for out in &outputs {
        checker.extend(read_jsonl(out).unwrap());
    }
    let report = checker.report();
    let processes = 3;
    assert_eq!(report.holds, processes * CHILD_TASKS * ROUNDS);
    assert!(report.is_clean(), "{report}");
    let counter: usize = conn.get(COUNTER).await.unwrap();
    assert_eq!(counter, processes * CHILD_TASKS * ROUNDS, "lost updates");
    assert_eq!(
        FencedResource::new(conn, FENCED).rejected().await.unwrap(),
        0
    );
}
