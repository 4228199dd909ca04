//! A TCP proxy that injects network faults between a client and one Redis server.
//!
//! A RedLock client talks to N independent masters, and its safety argument is
//! about what happens when some of them are slow, unreachable or silently
//! dropping traffic. Pausing or killing a `redis-server` only models the
//! server's side of that; a [`FaultProxy`] in front of each master models the
//! *network*: added latency, connections that break, and links that swallow
//! packets while looking alive.
//!
//! ```no_run
//! use std::time::Duration;
//! use distlock_testkit::{FaultProxy, RedisServer, TestkitError};
//!
//! # async fn demo() -> Result<(), TestkitError> {
//! let server = RedisServer::start().await?;
//! let proxy = FaultProxy::in_front_of(&server).await?;
//! let client = redis::Client::open(proxy.url())?;
//!
//! proxy.set_delay(Duration::from_millis(50)); // +100 ms per round trip
//! proxy.blackhole(); // requests vanish, clients wait for their own timeout
//! proxy.heal();
//! proxy.cut().await; // every connection is closed, new ones are refused
//! proxy.heal();
//! # Ok(())
//! # }
//! ```

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;

use crate::error::TestkitError;
use crate::redis_server::RedisServer;

/// Bytes read from a socket in one go; one read becomes one delayed chunk.
const CHUNK_BYTES: usize = 16 * 1024;
/// Chunks a direction may hold in its delay queue before the reader stops
/// reading, so a fast sender meets TCP back-pressure instead of filling memory.
const QUEUE_CHUNKS: usize = 256;
/// Pause after a failed `accept` (e.g. out of file descriptors), so a
/// persistent error does not turn the accept loop into a busy loop.
const ACCEPT_RETRY: Duration = Duration::from_millis(10);

/// Which way traffic flows through a [`FaultProxy`], for
/// [`set_delay_in`](FaultProxy::set_delay_in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Client to server: requests.
    ToServer,
    /// Server to client: replies.
    ToClient,
    /// Both directions.
    Both,
}

/// What the proxy currently does with traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Normal,
    Cut,
    Blackhole,
}

/// The fault configuration every task of a proxy watches.
///
/// `cuts` and `blackholes` count how often each fault was switched on. A
/// connection remembers the counters it was accepted under; if either has moved
/// since, the connection lived through that fault, even when a quick
/// `blackhole(); heal()` was coalesced by the watch channel and the connection
/// never saw the `Blackhole` mode itself.
#[derive(Debug, Clone, Copy)]
struct Faults {
    mode: Mode,
    to_server: Duration,
    to_client: Duration,
    cuts: u64,
    blackholes: u64,
}

impl Faults {
    /// Whether a connection accepted under `accepted` may still forward bytes.
    ///
    /// Once a connection has lost bytes to a blackhole its RESP stream is out
    /// of step (a reply would be matched to the wrong request), so it never
    /// forwards again, even after `heal()`; it is closed instead.
    fn forwards(&self, accepted: &Faults) -> bool {
        self.mode == Mode::Normal
            && accepted.mode == Mode::Normal
            && self.cuts == accepted.cuts
            && self.blackholes == accepted.blackholes
    }

    /// Whether a connection accepted under `accepted` must be closed now.
    fn closes(&self, accepted: &Faults) -> bool {
        let cut = self.mode == Mode::Cut || self.cuts != accepted.cuts;
        let was_blackholed =
            accepted.mode == Mode::Blackhole || self.blackholes != accepted.blackholes;
        cut || (was_blackholed && self.mode == Mode::Normal)
    }
}

/// A TCP proxy on a free `127.0.0.1` port in front of one upstream server,
/// able to delay, cut and blackhole the traffic on command.
///
/// Faults apply to connections that are already open as well as to new ones:
///
/// | fault | existing connections | new connections |
/// |---|---|---|
/// | [`set_delay`](Self::set_delay) | each chunk is held back by the delay of its direction, order preserved | same |
/// | [`cut`](Self::cut) | closed on both sides at once | accepted and closed immediately (client sees EOF) |
/// | [`blackhole`](Self::blackhole) | stay open; bytes in both directions are read and discarded | accepted, never connected upstream, bytes discarded |
/// | [`heal`](Self::heal) | connections that lived through a cut or blackhole are closed | forwarded normally |
///
/// Connections that were blackholed are closed on `heal()` rather than
/// resumed: the bytes they lost leave client and server out of step, and a
/// reply delivered to the wrong request would be a fault no real network
/// produces. Clients reconnect, as they would after a partition.
///
/// The proxy's tasks run on the Tokio runtime that called
/// [`start`](Self::start). Dropping the proxy aborts them: the listener closes
/// and every proxied connection is closed on both sides. Use
/// [`shutdown`](Self::shutdown) to wait until that has happened.
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    upstream: SocketAddr,
    faults: watch::Sender<Faults>,
    open: Arc<watch::Sender<usize>>,
    accept_task: JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy on a free `127.0.0.1` port forwarding to `upstream`.
    ///
    /// The upstream is connected anew for every accepted client, so the proxy
    /// keeps working across a [`RedisServer::restart`] (which keeps the port).
    /// Must be called within a Tokio runtime; the proxy's tasks are spawned on
    /// it.
    pub async fn start(upstream: SocketAddr) -> Result<FaultProxy, TestkitError> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .await
            .map_err(TestkitError::io("binding the fault proxy's listener"))?;
        let port = listener
            .local_addr()
            .map_err(TestkitError::io("reading the fault proxy's port"))?
            .port();
        let (faults, faults_rx) = watch::channel(Faults {
            mode: Mode::Normal,
            to_server: Duration::ZERO,
            to_client: Duration::ZERO,
            cuts: 0,
            blackholes: 0,
        });
        let open = Arc::new(watch::channel(0).0);
        let accept_task = tokio::spawn(accept_loop(listener, upstream, faults_rx, open.clone()));
        Ok(FaultProxy {
            port,
            upstream,
            faults,
            open,
            accept_task,
        })
    }

    /// Starts a proxy in front of `server` (see [`start`](Self::start)).
    pub async fn in_front_of(server: &RedisServer) -> Result<FaultProxy, TestkitError> {
        Self::start(SocketAddr::from((Ipv4Addr::LOCALHOST, server.port()))).await
    }

    /// The port the proxy listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The address traffic is forwarded to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Connection URL of the proxy, `redis://127.0.0.1:{port}/`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Delays every chunk by `delay` in *each* direction, so a request/reply
    /// round trip takes `2 * delay` longer. `Duration::ZERO` removes the delay.
    ///
    /// See [`set_delay_in`](Self::set_delay_in) for the details.
    pub fn set_delay(&self, delay: Duration) {
        self.set_delay_in(Direction::Both, delay);
    }

    /// Delays every chunk flowing in `direction` by `delay`; the other
    /// direction keeps its delay.
    ///
    /// The delay is latency, not a bandwidth limit: a chunk is due `delay`
    /// after the proxy read it, and chunks read meanwhile wait concurrently, so
    /// pipelined commands are not delayed one after another. Chunks leave in
    /// the order they arrived; after the delay is lowered a new chunk still
    /// waits for the older ones in front of it. The new value applies to open
    /// connections from the next chunk read on; chunks already queued keep the
    /// delay they were read under.
    ///
    /// [`Direction::ToClient`] alone models a slow acknowledgement: the server
    /// has executed the command before the client learns about it.
    pub fn set_delay_in(&self, direction: Direction, delay: Duration) {
        self.faults.send_modify(|faults| match direction {
            Direction::ToServer => faults.to_server = delay,
            Direction::ToClient => faults.to_client = delay,
            Direction::Both => {
                faults.to_server = delay;
                faults.to_client = delay;
            }
        });
    }

    /// Cuts the link: closes every open connection on both sides and refuses
    /// new ones (they are accepted and closed at once, so clients see EOF
    /// immediately instead of waiting for a timeout) until [`heal`](Self::heal).
    ///
    /// Returns once every connection has been closed, so
    /// [`connections`](Self::connections) is 0 afterwards. A connection still
    /// being accepted when `cut` is called is either closed before `cut`
    /// returns or refused.
    pub async fn cut(&self) {
        self.faults.send_modify(|faults| {
            faults.mode = Mode::Cut;
            faults.cuts += 1;
        });
        self.wait_for_connections(0).await;
    }

    /// Blackholes the link: connections stay open and new ones are accepted,
    /// but nothing is forwarded in either direction. Whatever arrives is read
    /// and discarded (so senders are not slowed down by full buffers), and
    /// chunks still in a delay queue are discarded too. Clients hang until
    /// their own timeouts fire.
    ///
    /// Connections that live through a blackhole are closed by
    /// [`heal`](Self::heal), see the [type documentation](Self).
    pub fn blackhole(&self) {
        self.faults.send_modify(|faults| {
            faults.mode = Mode::Blackhole;
            faults.blackholes += 1;
        });
    }

    /// Ends a [`cut`](Self::cut) or [`blackhole`](Self::blackhole): new
    /// connections are forwarded normally. Connections that were open during
    /// a blackhole are closed (both sides), because bytes they lost cannot be
    /// replayed. Delays set with [`set_delay`](Self::set_delay) stay in
    /// effect.
    pub fn heal(&self) {
        self.faults.send_modify(|faults| faults.mode = Mode::Normal);
    }

    /// The number of client connections currently open through the proxy
    /// (accepted and not yet closed; refused connections during a cut do not
    /// count).
    pub fn connections(&self) -> usize {
        *self.open.borrow()
    }

    /// Waits until exactly `count` client connections are open.
    ///
    /// Closing happens asynchronously (the client's close reaches the proxy
    /// over TCP, a blackholed connection is closed by a task after `heal`), so
    /// tests should wait for the count rather than read it once. Never returns
    /// if the count is never reached; bound it with a timeout.
    pub async fn wait_for_connections(&self, count: usize) {
        let mut open = self.open.subscribe();
        // `open` can only report an error once its sender is gone, and `self`
        // holds the sender, so the result carries no information.
        let _ = open.wait_for(|open| *open == count).await;
    }

    /// Stops the proxy and waits until its listener is closed and every
    /// proxied connection has been closed on both sides.
    ///
    /// Dropping the proxy does the same without waiting.
    pub async fn shutdown(mut self) {
        self.accept_task.abort();
        // The task was aborted, so the only possible outcome is "cancelled"
        // (or a panic, which the proxy's code does not produce); either way
        // the accept loop, its listener and its `JoinSet` are dropped now,
        // and dropping the set aborted every connection task.
        let _ = (&mut self.accept_task).await;
        self.wait_for_connections(0).await;
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        // Aborting the accept task drops its listener and its `JoinSet`, which
        // aborts every connection task, so none of them outlives the proxy.
        self.accept_task.abort();
    }
}

/// Counts one open client connection for as long as it lives.
struct OpenConnection {
    open: Arc<watch::Sender<usize>>,
}

impl OpenConnection {
    fn new(open: &Arc<watch::Sender<usize>>) -> OpenConnection {
        open.send_modify(|n| *n += 1);
        OpenConnection { open: open.clone() }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        // Runs when a connection task ends or is aborted, so the count cannot
        // leak open connections.
        self.open.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Accepts clients and spawns one task per connection into a `JoinSet` owned
/// by this loop, so aborting the loop also aborts every connection.
async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    mut faults: watch::Receiver<Faults>,
    open: Arc<watch::Sender<usize>>,
) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let client = match accepted {
                    Ok((client, _)) => client,
                    Err(error) => {
                        tracing::warn!(%error, "fault proxy: accept failed");
                        tokio::time::sleep(ACCEPT_RETRY).await;
                        continue;
                    }
                };
                // Reading the mode and counting the connection under the same
                // borrow of the watch (which `cut` must wait for to change the
                // mode) means a client is either counted before `cut` starts
                // waiting for the count to reach 0, or sees `Cut` and is
                // refused.
                let admitted = {
                    let now = faults.borrow();
                    (now.mode != Mode::Cut).then(|| (*now, OpenConnection::new(&open)))
                };
                // A refused client is dropped here: closed right after accept.
                if let Some((accepted_under, counted)) = admitted {
                    connections.spawn(serve(client, upstream, faults.clone(), accepted_under, counted));
                }
            }
            // Reap finished connections so the set does not grow without bound.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            changed = faults.changed() => {
                // The proxy was dropped; the abort is on its way, stop now.
                if changed.is_err() {
                    return;
                }
            }
        }
    }
}

/// Serves one client until it or the server closes, or a fault closes it.
async fn serve(
    client: TcpStream,
    upstream: SocketAddr,
    faults: watch::Receiver<Faults>,
    accepted: Faults,
    _counted: OpenConnection,
) {
    // Whichever finishes first ends the connection; dropping the relay future
    // drops both sockets, which closes them.
    tokio::select! {
        () = until_closed_by_fault(faults.clone(), accepted) => {}
        () = relay(client, upstream, faults, accepted) => {}
    }
}

/// Returns when a fault requires the connection to be closed, or when the
/// proxy is gone.
async fn until_closed_by_fault(mut faults: watch::Receiver<Faults>, accepted: Faults) {
    loop {
        if faults.borrow_and_update().closes(&accepted) {
            return;
        }
        if faults.changed().await.is_err() {
            return;
        }
    }
}

/// Connects upstream and pumps bytes both ways until either side closes.
async fn relay(
    client: TcpStream,
    upstream: SocketAddr,
    faults: watch::Receiver<Faults>,
    accepted: Faults,
) {
    if accepted.mode == Mode::Blackhole {
        // A blackholed link never reaches the server; the client's bytes just
        // disappear until it gives up or `heal`/`cut` closes the connection.
        discard(client).await;
        return;
    }
    let server = match TcpStream::connect(upstream).await {
        Ok(server) => server,
        Err(error) => {
            // Closing the client passes the unreachable server on as EOF.
            tracing::debug!(%error, %upstream, "fault proxy: upstream connect failed");
            return;
        }
    };
    // Small RESP messages must not wait for Nagle's algorithm; the only
    // latency should be the one the test asked for. Failing to set it only
    // costs speed.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    // The connection ends when either direction ends: Redis does not use
    // half-closed connections, so there is nothing to keep the other one for.
    tokio::select! {
        () = pipe(client_read, server_write, |f| f.to_server, faults.clone(), accepted) => {}
        () = pipe(server_read, client_write, |f| f.to_client, faults, accepted) => {}
    }
}

/// Reads and drops everything the client sends until it closes.
async fn discard(mut client: TcpStream) {
    let mut buf = vec![0u8; CHUNK_BYTES];
    while let Ok(n) = client.read(&mut buf).await {
        if n == 0 {
            return;
        }
    }
}

/// tokio's timer ticks in whole milliseconds, so a 100 µs delay would come out as about
/// 1 ms. The coarse part of a wait is left to the timer; the last millisecond is slept
/// by a thread of the blocking pool, whose sleep the OS times to tens of microseconds
/// (Linux's default timer slack is 50 µs).
const TIMER_TICK: Duration = Duration::from_millis(1);

/// Waits until `due`, to well under a millisecond.
async fn wait_until(due: Instant) {
    let now = Instant::now();
    if due <= now {
        return;
    }
    if due - now > 2 * TIMER_TICK {
        tokio::time::sleep_until(due - TIMER_TICK).await;
    }
    let left = due.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return;
    }
    if tokio::task::spawn_blocking(move || std::thread::sleep(left))
        .await
        .is_err()
    {
        // The blocking pool is shutting down with the runtime: the timer will do.
        tokio::time::sleep_until(due).await;
    }
}

/// A chunk of bytes in a delay queue with the time it may be written.
struct Chunk {
    due: Instant,
    bytes: Vec<u8>,
}

/// Forwards one direction: a reader stamps each chunk with its due time and
/// queues it, a writer waits for each chunk's due time in order and writes it.
///
/// Splitting reading from writing is what makes the delay latency rather than
/// throughput: while the writer waits for one chunk, the reader keeps taking
/// in the next ones with their own due times.
async fn pipe(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    delay_of: fn(&Faults) -> Duration,
    faults: watch::Receiver<Faults>,
    accepted: Faults,
) {
    let (queue, mut queued) = mpsc::channel::<Chunk>(QUEUE_CHUNKS);
    let read_faults = faults.clone();
    let reader = async move {
        let mut buf = vec![0u8; CHUNK_BYTES];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let now = *read_faults.borrow();
            if !now.forwards(&accepted) {
                // Blackholed (or about to be closed): swallow the bytes.
                continue;
            }
            let chunk = Chunk {
                due: Instant::now() + delay_of(&now),
                bytes: buf[..n].to_vec(),
            };
            if queue.send(chunk).await.is_err() {
                return;
            }
        }
        // Dropping `queue` here tells the writer that the stream has ended.
    };
    let writer = async move {
        while let Some(chunk) = queued.recv().await {
            wait_until(chunk.due).await;
            // A fault that began while the chunk waited drops it too:
            // a blackhole takes what is in flight.
            if !faults.borrow().forwards(&accepted) {
                continue;
            }
            if to.write_all(&chunk.bytes).await.is_err() {
                return;
            }
        }
        // The reader saw EOF and everything before it was delivered: pass the
        // EOF on.
        let _ = to.shutdown().await;
    };
    tokio::pin!(reader, writer);
    tokio::select! {
        // The reader ended (EOF or error): let the writer deliver what is
        // queued before the direction counts as finished.
        () = &mut reader => writer.await,
        // The writer only ends first when writing failed: the peer is gone.
        () = &mut writer => {}
    }
}
