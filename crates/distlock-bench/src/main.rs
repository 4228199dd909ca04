//! `distlock-bench`: measures distlock on a private redis-server, against baselines taken
//! by the same harness in the same run. Prints a table, or one JSON object per scenario
//! with `--json`.

mod baseline;
mod cost;
mod report;
mod scenarios;
mod slowlog;
mod stats;

use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use distlock::Client;
use distlock_testkit::RedisServer;

use report::Report;

/// Counts allocations, for the allocations-per-cycle figures.
#[global_allocator]
static ALLOCATOR: cost::CountingAllocator = cost::CountingAllocator;
use scenarios::{BenchResult, Plan};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Scenario {
    All,
    Uncontended,
    Parallel,
    Contended,
    Watchdog,
    Redlock,
    ReplicaSync,
    Cluster,
    Failover,
    Network,
    Fair,
    Rw,
    Semaphore,
    /// The distlock command against flock and redis-cli (not part of `all`).
    Cli,
    /// distlock on each store, and the peers on the same servers (not part of `all`: it
    /// starts a private PostgreSQL, etcd cluster and ZooKeeper ensemble too; etcd,
    /// ZooKeeper and the PostgreSQL peer need the `etcd`, `zk` and `peer-postgres`
    /// features).
    Stores,
}

#[derive(Debug, Parser)]
#[command(about = "Benchmark distlock on a private redis-server")]
struct Args {
    /// Which scenario to run.
    #[arg(long, value_enum, default_value_t = Scenario::All)]
    scenario: Scenario,
    /// Print one JSON object per scenario instead of the table.
    #[arg(long)]
    json: bool,
    /// Seconds each timed slice lasts.
    #[arg(long, default_value_t = 0.5, value_parser = positive_seconds)]
    secs: f64,
    /// Baseline/subject pairs per throughput scenario (contended: runs); medians are
    /// reported.
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u32).range(1..=1000))]
    runs: u32,
    /// Locks held in the watchdog scenario.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    watchdog_locks: u32,
    /// Benchmark this Redis instead of starting a private one (the watchdog scenario
    /// always uses a private server, to read its command counts undisturbed).
    #[arg(long)]
    url: Option<String>,
    /// Seconds the watchdog scenario holds them (the watchdog timeout is 30 s).
    #[arg(long, default_value_t = 30.0, value_parser = positive_seconds)]
    watchdog_secs: f64,
    /// The stores scenario's stores.
    #[arg(long, value_enum, default_value_t = scenarios::stores::StoreChoice::All)]
    store: scenarios::stores::StoreChoice,
    /// Internal: run as a worker process of the stores scenario.
    #[arg(long, hide = true, value_enum)]
    stores_worker: Option<scenarios::stores::worker::Role>,
    #[arg(long, hide = true, value_enum)]
    worker_subject: Option<scenarios::stores::subject::Subject>,
    /// Internal: run as a worker process of the fair scenario, taking this kind of lock.
    #[arg(long, hide = true, value_enum)]
    worker_kind: Option<scenarios::fair::Kind>,
    #[arg(long, hide = true, default_value_t = 0)]
    worker_first_task: usize,
    #[arg(long, hide = true, default_value_t = 1)]
    worker_tasks: usize,
    #[arg(long, hide = true, default_value_t = 0)]
    worker_start_ms: u64,
}

fn positive_seconds(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs > 0.0 && secs <= 3600.0 => Ok(secs),
        _ => Err(format!("{text:?} is not a number of seconds in (0, 3600]")),
    }
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    if let Err(err) = run(args).await {
        eprintln!("distlock-bench: {err}");
        std::process::exit(1);
    }
}

async fn run(args: Args) -> BenchResult<()> {
    if let Some(kind) = args.worker_kind {
        let url = args.url.as_deref().ok_or("a worker needs --url")?;
        return scenarios::fair::worker(
            kind,
            url,
            args.worker_first_task,
            args.worker_tasks,
            args.worker_start_ms,
            Duration::from_secs_f64(args.secs),
        )
        .await;
    }
    if let Some(role) = args.stores_worker {
        use scenarios::stores::worker;
        return worker::run(worker::Orders {
            role,
            subject: args
                .worker_subject
                .ok_or("a stores worker needs --worker-subject")?,
            url: args.url.as_deref().ok_or("a worker needs --url")?,
            first_task: args.worker_first_task,
            tasks: args.worker_tasks,
            start_ms: args.worker_start_ms,
            length: Duration::from_secs_f64(args.secs),
        })
        .await;
    }
    let server = RedisServer::start().await?;
    let url = args.url.clone().unwrap_or_else(|| server.url());
    let client = Client::connect(&url).await?;
    let plan = Plan {
        length: Duration::from_secs_f64(args.secs),
        runs: args.runs as usize,
    };
    eprintln!("{}", machine_note(&server).await);
    let wanted = |scenario| args.scenario == Scenario::All || args.scenario == scenario;
    let mut reports = Vec::new();
    let mut emit = |report: Report| {
        if args.json {
            match serde_json::to_string(&report) {
                Ok(line) => println!("{line}"),
                Err(err) => eprintln!("cannot encode report: {err}"),
            }
        }
        reports.push(report);
    };
    // First, on a fresh heap: its memory figure is a difference of resident sizes, which
    // memory freed by earlier scenarios would hide.
    if wanted(Scenario::Watchdog) {
        let hold = Duration::from_secs_f64(args.watchdog_secs);
        emit(scenarios::watchdog::run(&server, args.watchdog_locks as usize, hold).await?);
    }
    let peer = Arc::new(rslock::LockManager::new(vec![url.clone()]));
    // Command counts are read from the private server only: resetting a shared server's
    // statistics is not ours to do.
    let stats = match args.url {
        None => Some(server.connection().await?),
        Some(_) => None,
    };
    if wanted(Scenario::Uncontended) {
        emit(scenarios::uncontended::run(&client, &peer, stats.clone(), plan).await?);
    }
    if wanted(Scenario::Parallel) {
        emit(scenarios::parallel::run(&client, &peer, plan).await?);
    }
    if wanted(Scenario::Network) {
        // Server time per cycle does not depend on the network: measured here, on
        // loopback, in a task (as the uncontended scenario does), for every row.
        let server_time = match stats.clone() {
            Some(mut stats) => {
                let (client, peer) = (client.clone(), Arc::clone(&peer));
                let measured = tokio::spawn(async move {
                    let distlock =
                        scenarios::uncontended::distlock_cost(&client, &mut stats).await?;
                    let rslock = scenarios::uncontended::rslock_cost(&peer, &mut stats).await?;
                    BenchResult::Ok((distlock.server_micros, rslock.server_micros))
                });
                Some(measured.await??)
            }
            None => None,
        };
        for report in scenarios::network::run(&server, plan, server_time).await? {
            emit(report);
        }
    }
    if wanted(Scenario::Contended) {
        use scenarios::contended::{run, Implementation, NAME};
        let connection = client.connection();
        let distlock = Implementation::Distlock(client.lock(NAME)?);
        emit(run("contended", distlock, &connection, plan).await?);
        let peer = Implementation::Rslock(Arc::clone(&peer));
        emit(run("contended-rslock", peer, &connection, plan).await?);
    }
    if wanted(Scenario::Fair) {
        let connection = client.connection();
        for report in scenarios::fair::run(&url, &connection, plan).await? {
            emit(report);
        }
    }
    if wanted(Scenario::Rw) {
        for report in scenarios::rw::run(&client, plan).await? {
            emit(report);
        }
    }
    if wanted(Scenario::Semaphore) {
        for report in scenarios::semaphore::run(&client, &url, stats.clone(), plan).await? {
            emit(report);
        }
    }
    // These start servers of their own (5 masters; a master and a replica).
    // Spawns processes: asked for by name only.
    if args.scenario == Scenario::Cli {
        emit(scenarios::cli::run(&url, server.port(), args.runs as usize).await?);
    }
    if args.scenario == Scenario::Stores {
        for report in scenarios::stores::run(args.store, &url, plan).await? {
            emit(report);
        }
    }
    if wanted(Scenario::Redlock) {
        emit(scenarios::redlock::run(plan).await?);
    }
    if wanted(Scenario::ReplicaSync) {
        emit(scenarios::replica_sync::run(plan).await?);
    }
    if wanted(Scenario::Cluster) {
        emit(scenarios::cluster::run(&client, plan).await?);
    }
    if wanted(Scenario::Failover) {
        emit(scenarios::failover::run().await?);
    }
    // With --json, stdout carries only the JSON lines; the table is for people.
    if !args.json {
        report::print_header();
        for report in &reports {
            report::print_row(report);
        }
    }
    Ok(())
}

/// One line describing where the figures come from.
async fn machine_note(server: &RedisServer) -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|line| line.starts_with("model name"))
                .and_then(|line| line.split(':').nth(1))
                .map(|name| name.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let version = match server.connection().await {
        Ok(mut conn) => redis::cmd("INFO")
            .arg("server")
            .query_async::<String>(&mut conn)
            .await
            .ok()
            .and_then(|info| {
                info.lines()
                    .find_map(|line| line.strip_prefix("redis_version:").map(str::to_owned))
            })
            .unwrap_or_default(),
        Err(_) => String::new(),
    };
    format!("machine: {cores} cores, {cpu}; redis-server {version} on loopback (private, no persistence)")
}
