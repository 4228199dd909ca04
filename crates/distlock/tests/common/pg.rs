//! A private PostgreSQL for the reviews' tests (tests/review31_pg.rs, review31_pgrw.rs):
//! one that can be stopped and started again on the same port and data, with extra
//! settings and its log, which the testkit's `PostgresServer` does not offer.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use distlock_testkit::pick_free_port;
use sqlx::Connection;

/// A private PostgreSQL server and its data directory.
pub struct Pg {
    pub dir: tempfile::TempDir,
    pub bin: PathBuf,
    pub port: u16,
    pub settings: Vec<String>,
    pub child: Option<std::process::Child>,
    pub owner: Option<(u32, u32)>,
}

/// The uid and gid of the `postgres` system user when running as root.
pub fn postgres_user() -> Option<(u32, u32)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let uid = status
        .lines()
        .find(|line| line.starts_with("Uid:"))?
        .split_whitespace()
        .nth(1)?
        .to_owned();
    if uid != "0" {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        (fields.first() == Some(&"postgres"))
            .then(|| (fields[2].parse().ok(), fields[3].parse().ok()))
            .and_then(|(uid, gid)| Some((uid?, gid?)))
    })
}

pub fn pg_bin() -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL installed under /usr/lib/postgresql")
        .flatten()
        .map(|entry| entry.path().join("bin"))
        .filter(|bin| bin.join("initdb").exists())
        .collect();
    versions.sort();
    versions.pop().expect("a PostgreSQL version")
}

pub fn chown(path: &Path, owner: Option<(u32, u32)>) {
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(path, Some(uid), Some(gid)).expect("chown to postgres");
    }
}

pub fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{sig} {pid}");
}

impl Pg {
    pub async fn start(settings: &[&str]) -> Pg {
        let dir = tempfile::Builder::new()
            .prefix("distlock-pg-")
            .tempdir()
            .unwrap();
        let owner = postgres_user();
        chown(dir.path(), owner);
        let bin = pg_bin();
        let mut initdb = std::process::Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(dir.path().join("data"))
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some((uid, gid)) = owner {
            initdb.uid(uid).gid(gid);
        }
        let out = initdb.output().unwrap();
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pg = Pg {
            dir,
            bin,
            port: pick_free_port().unwrap(),
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
            child: None,
            owner,
        };
        pg.start_again().await;
        pg
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub async fn start_again(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir().join("log"))
            .unwrap();
        chown(&self.dir().join("log"), self.owner);
        let mut command = std::process::Command::new(self.bin.join("postgres"));
        command
            .arg("-D")
            .arg(self.dir().join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(self.dir())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=300",
            ]);
        for setting in &self.settings {
            command.args(["-c", setting]);
        }
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        if let Some((uid, gid)) = self.owner {
            command.uid(uid).gid(gid);
        }
        self.child = Some(command.spawn().unwrap());
        let give_up = Instant::now() + Duration::from_secs(30);
        loop {
            if sqlx::PgConnection::connect(&self.url()).await.is_ok() {
                return;
            }
            assert!(
                Instant::now() < give_up,
                "postgres did not start: {}",
                std::fs::read_to_string(self.dir().join("log")).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }

    pub fn stop(&mut self, how: &str) {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), how);
            child.wait().unwrap();
        }
    }

    pub fn url(&self) -> String {
        self.url_as("postgres")
    }

    pub fn url_as(&self, user: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/postgres", self.port)
    }

    pub async fn admin(&self) -> sqlx::PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&self.url())
            .await
            .unwrap()
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir().join("log")).unwrap_or_default()
    }

    /// The log's lines about deadlocks, with the statements involved.
    pub fn deadlocks(&self) -> Vec<String> {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        let mut found = Vec::new();
        for (at, line) in lines.iter().enumerate() {
            if line.contains("deadlock detected") {
                let end = (at + 40).min(lines.len());
                found.push(lines[at..end].join("\n"));
            }
        }
        found
    }
}

impl Drop for Pg {
    fn drop(&mut self) {
        self.stop("QUIT");
    }
}

/// A client of the reviews' tests: a short response timeout, so faults show quickly.
pub async fn client_at(url: &str, watchdog: Duration) -> distlock::Client {
    distlock::Client::builder()
        .watchdog_timeout(watchdog)
        .response_timeout(Duration::from_millis(500))
        .connection_timeout(Duration::from_secs(2))
        .connect(url)
        .await
        .expect("connect to postgres")
}

/// Backends waiting for a heavyweight lock (a row or table lock).
pub async fn lock_waiters(admin: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'")
        .fetch_one(admin)
        .await
        .unwrap()
}
