//! `./dev demo`: two OS processes, three tasks each, contend for one lock on a private
//! redis-server. Prints who held it, their fencing tokens, the handoff gaps, and then a
//! lost lease being signalled and fenced off.

use std::process::Stdio;
use std::time::Duration;

use distlock::Client;
use distlock_testkit::{analyze, monotonic_ns, FencedResource, Interval, RedisServer};
use tokio::io::{AsyncBufReadExt, BufReader};

const LOCK: &str = "demo:nightly-report";
const TASKS: usize = 3;
const ROUNDS: usize = 4;
const HOLD: Duration = Duration::from_millis(20);

type AnyResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let outcome = match args.get(1).map(String::as_str) {
        Some("--child") => match (args.get(2), args.get(3)) {
            (Some(url), Some(name)) => child(url, name).await,
            _ => Err("usage: demo --child <redis url> <process name>".into()),
        },
        _ => parent().await,
    };
    if let Err(err) = outcome {
        eprintln!("demo failed: {err}");
        std::process::exit(1);
    }
}

/// Runs this process's contenders and prints one JSON interval per hold on stdout.
async fn child(url: &str, process: &str) -> AnyResult<()> {
    for interval in contend(url, process).await? {
        println!("{}", serde_json::to_string(&interval)?);
    }
    Ok(())
}

async fn contend(url: &str, process: &str) -> AnyResult<Vec<Interval>> {
    let client = Client::connect(url).await?;
    let mut tasks = Vec::new();
    for task in 0..TASKS {
        let lock = client.lock(LOCK)?;
        let holder = format!("{process}/task{task}");
        tasks.push(tokio::spawn(async move {
            let mut holds = Vec::new();
            for _ in 0..ROUNDS {
                let guard = lock.lock().await?;
                let start_ns = monotonic_ns();
                tokio::time::sleep(HOLD).await;
                let end_ns = monotonic_ns();
                let token = guard.fencing_token();
                guard.release().await?;
                holds.push(Interval {
                    start_ns,
                    end_ns,
                    token,
                    holder: holder.clone(),
                });
            }
            Ok::<_, distlock::Error>(holds)
        }));
    }
    let mut intervals = Vec::new();
    for task in tasks {
        intervals.extend(task.await??);
    }
    // A graceful exit: background releases are flushed, the client's runtime stops.
    client.shutdown().await;
    Ok(intervals)
}

async fn parent() -> AnyResult<()> {
    let server = RedisServer::start().await?;
    let url = server.url();
    println!(
        "distlock demo: private redis-server on 127.0.0.1:{}",
        server.port()
    );
    println!(
        "2 processes x {TASKS} tasks contend for lock {LOCK:?}: {ROUNDS} rounds each, holding {} ms\n",
        HOLD.as_millis()
    );

    let mut other = tokio::process::Command::new(std::env::current_exe()?)
        .args(["--child", &url, "p2"])
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let child_out = other.stdout.take().ok_or("child has no stdout")?;
    let read_child = async {
        let mut lines = BufReader::new(child_out).lines();
        let mut intervals = Vec::new();
        while let Some(line) = lines.next_line().await? {
            intervals.push(serde_json::from_str::<Interval>(&line)?);
        }
        AnyResult::Ok(intervals)
    };
    let (mine, theirs) = tokio::join!(contend(&url, "p1"), read_child);
    let status = other.wait().await?;
    if !status.success() {
        return Err(format!("the second process failed: {status}").into());
    }
    let mut intervals = mine?;
    intervals.extend(theirs?);
    intervals.sort_by_key(|interval| interval.start_ns);
    print_timeline(&intervals);

    lost_lease(&url).await
}

fn print_timeline(intervals: &[Interval]) {
    let Some(first) = intervals.first() else {
        return;
    };
    let origin = first.start_ns;
    println!(
        "{:>9}  {:<10} {:>6} {:>9} {:>12}",
        "t (ms)", "holder", "token", "held ms", "handoff"
    );
    let mut gaps = Vec::new();
    for (index, interval) in intervals.iter().enumerate() {
        let handoff = match index.checked_sub(1).map(|prev| &intervals[prev]) {
            Some(prev) => {
                let gap = interval.start_ns.saturating_sub(prev.end_ns);
                gaps.push(gap);
                format!("{:.3} ms", gap as f64 / 1e6)
            }
            None => "-".to_owned(),
        };
        println!(
            "{:>9.2}  {:<10} {:>6} {:>9.2} {:>12}",
            (interval.start_ns - origin) as f64 / 1e6,
            interval.holder,
            interval.token,
            (interval.end_ns - interval.start_ns) as f64 / 1e6,
            handoff,
        );
    }
    let report = analyze(intervals);
    gaps.sort_unstable();
    let median = gaps.get(gaps.len() / 2).copied().unwrap_or(0);
    let worst = gaps.last().copied().unwrap_or(0);
    println!(
        "\n{} holds, {} overlaps, {} token regressions; handoff median {:.3} ms, max {:.3} ms",
        report.holds,
        report.overlaps.len(),
        report.token_regressions.len(),
        median as f64 / 1e6,
        worst as f64 / 1e6,
    );
    println!("(a handoff includes the holder's release round trip, the pub/sub wake-up and the next acquire)\n");
}

/// A holder loses its lock behind its back; the lost signal fires and the fenced store
/// refuses its late write.
async fn lost_lease(url: &str) -> AnyResult<()> {
    let watchdog = Duration::from_secs(1);
    let client = Client::builder()
        .watchdog_timeout(watchdog)
        .connect(url)
        .await?;
    let operator = Client::connect(url).await?;
    let store = FencedResource::new(
        redis::Client::open(url)?
            .get_multiplexed_async_connection()
            .await?,
        "demo:store",
    );

    println!("Lost lease:");
    let guard = client.lock("demo:lost")?.lock().await?;
    let stale_token = guard.fencing_token();
    store
        .write(stale_token, "written by the first holder")
        .await?;
    println!(
        "  holder A has \"demo:lost\" (token {stale_token}), watchdog lease {} ms",
        watchdog.as_millis()
    );
    let deleted_at = std::time::Instant::now();
    operator.lock("demo:lost")?.force_unlock().await?;
    println!("  an operator force-unlocks it");
    tokio::time::timeout(watchdog, guard.lost())
        .await
        .map_err(|_| "lost() did not fire within the lease")?;
    println!(
        "  A's lost() fired {:.0} ms later (at its next renewal; never later than the lease)",
        deleted_at.elapsed().as_secs_f64() * 1e3
    );
    let successor = operator.lock("demo:lost")?.lock().await?;
    store
        .write(successor.fencing_token(), "written by B")
        .await?;
    println!(
        "  holder B takes it with token {}",
        successor.fencing_token()
    );
    let accepted = store.write(stale_token, "late write by A").await?;
    println!(
        "  A's late write with token {stale_token}: {} (stale writes rejected: {})",
        if accepted {
            "ACCEPTED (bug!)"
        } else {
            "rejected by the fenced store"
        },
        store.rejected().await?
    );
    successor.release().await?;
    let _ = guard.release().await;
    client.shutdown().await;
    operator.shutdown().await;
    Ok(())
}
