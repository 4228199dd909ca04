//! A real ZooKeeper ensemble for tests: 1 server (standalone) or 3 (a quorum) on free
//! loopback ports, each a JVM running `org.apache.zookeeper.server.quorum.QuorumPeerMain`
//! with its data in a private temporary directory, killed when the [`ZkEnsemble`] is
//! dropped.
//!
//! The tick is short ([`ZK_TICK`], 200 ms), so sessions can be short too: the servers
//! grant timeouts from [`ZK_MIN_SESSION_TIMEOUT`] (two ticks) to
//! [`ZK_MAX_SESSION_TIMEOUT`]. Followers give up on a silent leader after five ticks
//! (`syncLimit`), so a new leader is elected about a second after the old one dies.
//!
//! The harness reads the servers' state with the four-letter words (`srvr`, `ruok`, all
//! enabled), so it needs no ZooKeeper client.
//!
//! Start-up is the JVM's: on this machine (2 cores, OpenJDK 17, ZooKeeper 3.8.0) a
//! 3-server ensemble answers `srvr` with a leader and two followers 1.2–2.3 s after the
//! processes are spawned (the more, the busier the machine), a standalone server in
//! 0.3–2.4 s (usually under 0.7 s); a new leader is elected 0.4–0.8 s after the old one
//! is killed, and a restarted server follows again within 0.5–0.9 s.
//!
//! ```no_run
//! use distlock_testkit::{TestkitError, ZkEnsemble};
//!
//! # async fn demo() -> Result<(), TestkitError> {
//! let mut ensemble = ZkEnsemble::start(3).await?;
//! let url = ensemble.url(); // zk://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3
//! let old = ensemble.leader().await?;
//! ensemble.kill(old).await?;
//! let new = ensemble.leader().await?; // among the servers still running
//! ensemble.restart(old).await?;        // same data, same ports; back as a follower
//! # let _ = (url, new);
//! # Ok(())
//! # }
//! ```

use std::ffi::OsString;
use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::error::TestkitError;
use crate::probe::{poll, POLL_INTERVAL, QUERY_TIMEOUT};
use crate::store_process::{find_on_path, pick_free_ports, StoreProcess};

/// Environment variable giving the Java class path of the ZooKeeper server (for a
/// release tarball: `/opt/zookeeper/lib/*`). Default: Debian's
/// `/usr/share/java/zookeeper.jar`, whose manifest names its dependencies, plus
/// `slf4j-simple.jar` when present so the servers' log reaches the diagnostics.
pub const ZK_CLASSPATH_ENV: &str = "DISTLOCK_ZK_CLASSPATH";
/// Environment variable naming the `java` binary to use instead of the one on `PATH`.
pub const JAVA_ENV: &str = "DISTLOCK_JAVA";

/// ZooKeeper's time unit in these ensembles (`tickTime`).
pub const ZK_TICK: Duration = Duration::from_millis(200);
/// The shortest session timeout the servers grant (`minSessionTimeout`, two ticks).
pub const ZK_MIN_SESSION_TIMEOUT: Duration = Duration::from_millis(400);
/// The longest session timeout the servers grant (`maxSessionTimeout`).
pub const ZK_MAX_SESSION_TIMEOUT: Duration = Duration::from_secs(60);

const STORE: &str = "ZooKeeper";
const DEBIAN_JAR: &str = "/usr/share/java/zookeeper.jar";
const DEBIAN_SLF4J_SIMPLE: &str = "/usr/share/java/slf4j-simple.jar";
/// Bound on an ensemble (or a restarted server) serving, and on a leader election. A JVM
/// start on a loaded two-core machine takes seconds.
const READY_TIMEOUT: Duration = Duration::from_secs(45);
/// Starts tried on fresh ports when a server could not bind the ports it was given.
const START_ATTEMPTS: u32 = 3;

/// One ZooKeeper server process.
#[derive(Debug)]
struct Server {
    client_port: u16,
    process: StoreProcess,
}

/// What `srvr` says a server is doing.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    Leader,
    Follower,
    Standalone,
    /// Anything else, e.g. `This ZooKeeper instance is not currently serving requests`.
    NotServing(String),
}

/// A ZooKeeper ensemble of 1 or 3 servers on loopback.
#[derive(Debug)]
pub struct ZkEnsemble {
    servers: Vec<Server>,
    _dir: TempDir,
}

impl ZkEnsemble {
    /// Starts `servers` ZooKeeper servers (1: standalone; 3: a quorum of three) and waits
    /// until each one answers `srvr` as serving: `standalone`, or one `leader` and the
    /// rest `follower`.
    ///
    /// Java is taken from `DISTLOCK_JAVA` or `PATH`, the server's classes from
    /// `DISTLOCK_ZK_CLASSPATH` or Debian's `zookeeper` package.
    pub async fn start(servers: usize) -> Result<ZkEnsemble, TestkitError> {
        if servers != 1 && servers != 3 {
            return Err(TestkitError::Topology(format!(
                "a ZooKeeper ensemble of {servers} servers: only 1 or 3 are supported"
            )));
        }
        let java = find_java()?;
        let classpath = classpath()?;
        let dir = tempfile::Builder::new()
            .prefix("distlock-zk-")
            .tempdir()
            .map_err(TestkitError::io("creating a directory for ZooKeeper"))?;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut started = spawn_servers(&java, &classpath, dir.path(), servers)?;
            match wait_ready(&mut started).await {
                Ok(()) => {
                    return Ok(ZkEnsemble {
                        servers: started,
                        _dir: dir,
                    })
                }
                Err(err) if attempt < START_ATTEMPTS && lost_a_port(&started) => {
                    tracing::warn!(error = %err, attempt, "ZooKeeper could not bind its ports; trying others");
                    for server in &mut started {
                        server.process.kill().await?;
                    }
                }
                Err(err) => return Err(err),
            }
        }
    }

    /// How many servers the ensemble has (running or not).
    pub fn size(&self) -> usize {
        self.servers.len()
    }

    /// The client ports, in index order (stable across restarts).
    pub fn client_ports(&self) -> Vec<u16> {
        self.servers
            .iter()
            .map(|server| server.client_port)
            .collect()
    }

    /// `127.0.0.1:p1,127.0.0.1:p2,…`, the connect string ZooKeeper clients take.
    pub fn connect_string(&self) -> String {
        self.client_ports()
            .into_iter()
            .map(|port| format!("127.0.0.1:{port}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// `zk://127.0.0.1:p1,127.0.0.1:p2,…`: the whole ensemble in one URL.
    pub fn url(&self) -> String {
        format!("zk://{}", self.connect_string())
    }

    /// The process id of server `index`; `None` after [`kill`](Self::kill).
    pub fn pid(&self, index: usize) -> Option<u32> {
        self.servers.get(index)?.process.pid()
    }

    /// The last lines (up to 60) server `index` logged, oldest first.
    pub fn recent_log(&self, index: usize) -> Vec<String> {
        self.servers
            .get(index)
            .map(|server| server.process.recent_log())
            .unwrap_or_default()
    }

    /// Sends a four-letter word (`srvr`, `mntr`, `cons`, `stat`, …) to server `index`
    /// and returns its whole answer.
    pub async fn four_letter_word(&self, index: usize, word: &str) -> Result<String, TestkitError> {
        four_letter_word(self.server(index)?.client_port, word).await
    }

    /// The index of the current leader (of the standalone server, for one): waits (up to
    /// 45 s) until a server that runs and is not frozen says `Mode: leader` and every
    /// other such server says `follower`. So right after the leader is killed or frozen
    /// this waits for the election of the next.
    pub async fn leader(&self) -> Result<usize, TestkitError> {
        let live: Vec<usize> = (0..self.servers.len())
            .filter(|&index| self.servers[index].process.is_live())
            .collect();
        let servers = &self.servers;
        poll("a ZooKeeper leader", READY_TIMEOUT, || {
            let live = &live;
            async move {
                let mut modes = Vec::with_capacity(live.len());
                for &index in live {
                    modes.push(mode(servers[index].client_port).await);
                }
                let leaders: Vec<usize> = live
                    .iter()
                    .zip(&modes)
                    .filter(|(_, mode)| matches!(mode, Mode::Leader | Mode::Standalone))
                    .map(|(&index, _)| index)
                    .collect();
                let followers = modes.iter().filter(|mode| **mode == Mode::Follower).count();
                match leaders.as_slice() {
                    [leader] if followers + 1 == live.len() => Ok(*leader),
                    _ => Err(format!("servers {live:?} say {modes:?}")),
                }
            }
        })
        .await
    }

    /// Kills server `index` with SIGKILL and waits until it has exited. Its data stays
    /// for [`restart`](Self::restart).
    pub async fn kill(&mut self, index: usize) -> Result<(), TestkitError> {
        self.server_mut(index)?.process.kill().await
    }

    /// Freezes server `index` with SIGSTOP: its connections stay open but it answers
    /// nothing, so its clients' sessions run out.
    pub fn stop(&self, index: usize) -> Result<(), TestkitError> {
        self.server(index)?.process.pause()
    }

    /// Continues server `index` after [`stop`](Self::stop) (SIGCONT).
    pub fn resume(&self, index: usize) -> Result<(), TestkitError> {
        self.server(index)?.process.resume()
    }

    /// Kills server `index` if it runs, starts it again on the same ports with the same
    /// data, and waits until it serves again (as a follower, or leader, or standalone).
    pub async fn restart(&mut self, index: usize) -> Result<(), TestkitError> {
        let server = self.server_mut(index)?;
        server.process.restart().await?;
        wait_serving(server, READY_TIMEOUT).await
    }

    fn server(&self, index: usize) -> Result<&Server, TestkitError> {
        self.servers.get(index).ok_or_else(|| no_server(index))
    }

    fn server_mut(&mut self, index: usize) -> Result<&mut Server, TestkitError> {
        self.servers.get_mut(index).ok_or_else(|| no_server(index))
    }
}

fn no_server(index: usize) -> TestkitError {
    TestkitError::Topology(format!("the ZooKeeper ensemble has no server {index}"))
}

fn find_java() -> Result<PathBuf, TestkitError> {
    if let Some(path) = std::env::var_os(JAVA_ENV).filter(|path| !path.is_empty()) {
        return Ok(PathBuf::from(path));
    }
    find_on_path("java").ok_or_else(|| TestkitError::StoreNotInstalled {
        store: STORE,
        hint: format!(
            "no java in ${JAVA_ENV} or PATH; `apt-get install zookeeper` brings ZooKeeper and a JRE"
        ),
    })
}

fn classpath() -> Result<OsString, TestkitError> {
    if let Some(classpath) = std::env::var_os(ZK_CLASSPATH_ENV).filter(|cp| !cp.is_empty()) {
        return Ok(classpath);
    }
    if !Path::new(DEBIAN_JAR).is_file() {
        return Err(TestkitError::StoreNotInstalled {
            store: STORE,
            hint: format!(
                "${ZK_CLASSPATH_ENV} is unset and there is no {DEBIAN_JAR}; install it with \
                 `apt-get install zookeeper`"
            ),
        });
    }
    let mut classpath = OsString::from(DEBIAN_JAR);
    if Path::new(DEBIAN_SLF4J_SIMPLE).is_file() {
        classpath.push(":");
        classpath.push(DEBIAN_SLF4J_SIMPLE);
    }
    Ok(classpath)
}

/// The configuration of server `id` (1-based) of an ensemble whose servers listen on
/// `ports[i] = (client, quorum, election)`.
fn config(id: usize, data: &Path, ports: &[(u16, u16, u16)]) -> String {
    let mut config = format!(
        "tickTime={tick}\n\
         initLimit=10\n\
         syncLimit=5\n\
         minSessionTimeout={min}\n\
         maxSessionTimeout={max}\n\
         dataDir={data}\n\
         clientPort={client}\n\
         clientPortAddress=127.0.0.1\n\
         4lw.commands.whitelist=*\n\
         admin.enableServer=false\n\
         forceSync=no\n\
         reconfigEnabled=false\n",
        tick = ZK_TICK.as_millis(),
        min = ZK_MIN_SESSION_TIMEOUT.as_millis(),
        max = ZK_MAX_SESSION_TIMEOUT.as_millis(),
        data = data.display(),
        client = ports[id - 1].0,
    );
    // A single server without `server.N` lines runs standalone.
    if ports.len() > 1 {
        for (index, (_, quorum, election)) in ports.iter().enumerate() {
            let _ = writeln!(config, "server.{}=127.0.0.1:{quorum}:{election}", index + 1);
        }
    }
    config
}

/// Writes each server's configuration and `myid` under `dir/s<id>` (replacing what an
/// earlier attempt left) and spawns the servers on fresh ports.
fn spawn_servers(
    java: &Path,
    classpath: &OsString,
    dir: &Path,
    count: usize,
) -> Result<Vec<Server>, TestkitError> {
    let picked = pick_free_ports(3 * count)?;
    let ports: Vec<(u16, u16, u16)> = picked
        .chunks_exact(3)
        .map(|chunk| (chunk[0], chunk[1], chunk[2]))
        .collect();
    let mut servers = Vec::with_capacity(count);
    for id in 1..=count {
        let home = dir.join(format!("s{id}"));
        if home.exists() {
            std::fs::remove_dir_all(&home)
                .map_err(TestkitError::io(format!("removing {}", home.display())))?;
        }
        let data = home.join("data");
        std::fs::create_dir_all(&data)
            .map_err(TestkitError::io(format!("creating {}", data.display())))?;
        std::fs::write(data.join("myid"), format!("{id}\n"))
            .map_err(TestkitError::io("writing myid"))?;
        let config_path = home.join("zoo.cfg");
        std::fs::write(&config_path, config(id, &data, &ports))
            .map_err(TestkitError::io("writing zoo.cfg"))?;
        let mut args: Vec<OsString> = [
            "-Xmx256m",
            "-XX:+UseSerialGC",
            // C1 only: the server runs for seconds, and C2 compiling on two cores slows
            // the start.
            "-XX:TieredStopAtLevel=1",
            "-XX:-UsePerfData",
            "-Djava.net.preferIPv4Stack=true",
            "-Dzookeeper.jmx.log4j.disable=true",
            // Transaction logs grow in 4 MiB steps instead of 64 MiB.
            "-Dzookeeper.preAllocSize=4096",
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=info",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-Dorg.slf4j.simpleLogger.dateTimeFormat=HH:mm:ss.SSS",
        ]
        .into_iter()
        .map(OsString::from)
        .collect();
        args.push("-cp".into());
        args.push(classpath.clone());
        args.push("org.apache.zookeeper.server.quorum.QuorumPeerMain".into());
        args.push(config_path.into_os_string());
        let process =
            StoreProcess::spawn(format!("ZooKeeper server {}", id - 1), java.into(), args)?;
        servers.push(Server {
            client_port: ports[id - 1].0,
            process,
        });
    }
    Ok(servers)
}

/// Waits until every server serves: standalone, or one leader and the rest followers.
/// Fails at once if a server exits.
async fn wait_ready(servers: &mut [Server]) -> Result<(), TestkitError> {
    let started = Instant::now();
    let deadline = started + READY_TIMEOUT;
    let mut modes = Vec::new();
    loop {
        if let Some((index, status)) = servers
            .iter_mut()
            .enumerate()
            .find_map(|(index, server)| server.process.exited().map(|status| (index, status)))
        {
            return Err(TestkitError::Store {
                store: STORE,
                what: format!("server {index} exited while starting ({status})"),
                output: servers[index].process.log_text(),
            });
        }
        modes.clear();
        for server in servers.iter() {
            modes.push(mode(server.client_port).await);
        }
        let ready = if servers.len() == 1 {
            modes == [Mode::Standalone]
        } else {
            modes.iter().filter(|mode| **mode == Mode::Leader).count() == 1
                && modes
                    .iter()
                    .all(|mode| matches!(mode, Mode::Leader | Mode::Follower))
        };
        if ready {
            return Ok(());
        }
        if Instant::now() + POLL_INTERVAL >= deadline {
            return Err(TestkitError::Store {
                store: STORE,
                what: format!(
                    "the ensemble was not serving after {:?}; modes: {modes:?}",
                    started.elapsed()
                ),
                output: servers
                    .iter()
                    .map(|server| {
                        format!(
                            "--- {}:\n{}",
                            server.process.label(),
                            server.process.log_text()
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Waits until a (re)started server answers `srvr` as serving.
async fn wait_serving(server: &mut Server, limit: Duration) -> Result<(), TestkitError> {
    let started = Instant::now();
    loop {
        if let Some(status) = server.process.exited() {
            return Err(TestkitError::Store {
                store: STORE,
                what: format!(
                    "{} exited after a restart ({status})",
                    server.process.label()
                ),
                output: server.process.log_text(),
            });
        }
        let mode = mode(server.client_port).await;
        if matches!(mode, Mode::Leader | Mode::Follower | Mode::Standalone) {
            return Ok(());
        }
        if started.elapsed() + POLL_INTERVAL >= limit {
            return Err(TestkitError::Store {
                store: STORE,
                what: format!(
                    "{} did not serve again within {limit:?}; last: {mode:?}",
                    server.process.label()
                ),
                output: server.process.log_text(),
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Whether a server ended because a port was taken between picking it and binding it.
fn lost_a_port(servers: &[Server]) -> bool {
    servers.iter().any(|server| {
        server
            .process
            .log_text()
            .to_ascii_lowercase()
            .contains("address already in use")
    })
}

/// The server's mode from `srvr`; not serving when it cannot be asked.
async fn mode(port: u16) -> Mode {
    match four_letter_word(port, "srvr").await {
        Ok(answer) => parse_mode(&answer),
        Err(err) => Mode::NotServing(err.to_string()),
    }
}

fn parse_mode(srvr: &str) -> Mode {
    match srvr
        .lines()
        .find_map(|line| line.strip_prefix("Mode:"))
        .map(str::trim)
    {
        Some("leader") => Mode::Leader,
        Some("follower") => Mode::Follower,
        Some("standalone") => Mode::Standalone,
        _ => Mode::NotServing(srvr.trim().to_owned()),
    }
}

/// Sends `word` and reads the answer until the server closes the connection, bounded by
/// the query timeout (a frozen server accepts the connection but never answers).
async fn four_letter_word(port: u16, word: &str) -> Result<String, TestkitError> {
    let exchange = async {
        let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await?;
        stream.write_all(word.as_bytes()).await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        Ok::<_, std::io::Error>(answer)
    };
    let answer = tokio::time::timeout(QUERY_TIMEOUT, exchange)
        .await
        .map_err(|_| TestkitError::Timeout {
            what: format!("an answer to `{word}` from port {port}"),
            waited: QUERY_TIMEOUT,
            last: "no reply (is the server frozen?)".to_owned(),
        })?
        .map_err(TestkitError::io(format!("`{word}` on port {port}")))?;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_mode_from_srvr() {
        let srvr = "Zookeeper version: 3.8.0-debian, built on 2024-06-16 14:20 UTC\n\
                    Latency min/avg/max: 0/0.0/0\nReceived: 2\nSent: 1\nConnections: 1\n\
                    Outstanding: 0\nZxid: 0x100000000\nMode: follower\nNode count: 5\n";
        assert_eq!(parse_mode(srvr), Mode::Follower);
        assert_eq!(parse_mode("Mode: leader\n"), Mode::Leader);
        assert_eq!(parse_mode("Mode: standalone\n"), Mode::Standalone);
        let busy = "This ZooKeeper instance is not currently serving requests\n";
        assert_eq!(parse_mode(busy), Mode::NotServing(busy.trim().to_owned()));
    }

    #[test]
    fn configures_a_quorum_or_a_standalone_server() {
        let data = Path::new("/tmp/zk/s2/data");
        let three = config(2, data, &[(1, 2, 3), (4, 5, 6), (7, 8, 9)]);
        assert!(three.contains("clientPort=4\n"), "{three}");
        assert!(three.contains("tickTime=200\n"), "{three}");
        assert!(three.contains("minSessionTimeout=400\n"), "{three}");
        assert!(three.contains("server.1=127.0.0.1:2:3\n"), "{three}");
        assert!(three.contains("server.3=127.0.0.1:8:9\n"), "{three}");
        let one = config(1, data, &[(1, 2, 3)]);
        assert!(!one.contains("server."), "{one}");
    }
}
