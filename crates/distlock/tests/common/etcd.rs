//! The etcd reviews' fixtures: clusters, clients, and etcd's v3 JSON gateway (and
//! `/metrics`) over plain HTTP/1.1, to look at what distlock keeps without its own client.

use std::time::Duration;

use distlock::Client;
use distlock_testkit::EtcdCluster;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A cluster of `members` members.
pub async fn cluster(members: usize) -> EtcdCluster {
    EtcdCluster::start(members).await.expect("start etcd")
}

/// A client with these timeouts (and 5 s to connect).
pub async fn client_with(url: &str, watchdog: Duration, response: Duration) -> Client {
    Client::builder()
        .watchdog_timeout(watchdog)
        .response_timeout(response)
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .expect("connect to etcd")
}

/// A client with a 2 s response timeout.
pub async fn client_at(url: &str, watchdog: Duration) -> Client {
    client_with(url, watchdog, Duration::from_secs(2)).await
}

const BASE64: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Base64, as the gateway carries keys and values.
pub fn b64(bytes: &[u8]) -> String {
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .fold(0_u32, |n, byte| (n << 8) | u32::from(*byte))
            << (8 * (3 - chunk.len()));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(BASE64[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The bytes of a gateway's base64 text.
pub fn unb64(text: &str) -> Vec<u8> {
    let digits: Vec<u32> = text
        .trim_end_matches('=')
        .bytes()
        .map(|b| BASE64.iter().position(|&d| d == b).unwrap() as u32)
        .collect();
    let mut out = Vec::new();
    for chunk in digits.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, d)| n | (d << (18 - 6 * i as u32)));
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..chunk.len() - 1]);
    }
    out
}

/// One HTTP/1.1 request to a member's client port (with an auth `token`, if any): its
/// status and body.
pub async fn http(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    token: Option<&str>,
) -> (u16, String) {
    let auth = token.map_or(String::new(), |t| format!("Authorization: {t}\r\n"));
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(5), exchange)
        .await
        .expect("gateway answered in time")
        .expect("gateway request");
    let text = String::from_utf8_lossy(&response).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_owned()
    };
    (code, body)
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    loop {
        let Some((size, tail)) = rest.split_once("\r\n") else {
            return out;
        };
        let size = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if size == 0 {
            return out;
        }
        out.push_str(&tail[..size]);
        rest = &tail[size + 2..];
    }
}

/// One POST to the gateway as `token`'s user; its JSON answer (it must be 200).
pub async fn gw_as(port: u16, path: &str, body: Value, token: Option<&str>) -> Value {
    let (code, text) = http(port, "POST", path, &body.to_string(), token).await;
    assert_eq!(code, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

/// One POST to the gateway; its JSON answer (it must be 200).
pub async fn gw(port: u16, path: &str, body: Value) -> Value {
    gw_as(port, path, body, None).await
}

/// A number the gateway may send as a string.
pub fn num(value: &Value) -> i64 {
    match value {
        Value::String(text) => text.parse().unwrap_or(0),
        other => other.as_i64().unwrap_or(0),
    }
}

/// The keys of lock `name`'s queue (default prefix), oldest first: (what follows the
/// queue's NUL, create revision, lease id).
pub async fn queue(port: u16, name: &str) -> Vec<(String, i64, i64)> {
    queue_under(port, &format!("distlock/{name}\0")).await
}

/// The keys under `prefix`, oldest first: (what follows their last NUL, create revision,
/// lease id).
pub async fn queue_under(port: u16, prefix: &str) -> Vec<(String, i64, i64)> {
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    let reply = gw(
        port,
        "/v3/kv/range",
        json!({"key": b64(prefix.as_bytes()), "range_end": b64(&end),
               "sort_order": "ASCEND", "sort_target": "CREATE", "keys_only": true}),
    )
    .await;
    reply["kvs"]
        .as_array()
        .map(|kvs| {
            kvs.iter()
                .map(|kv| {
                    let key =
                        String::from_utf8_lossy(&unb64(kv["key"].as_str().unwrap())).into_owned();
                    let owner = key.rsplit_once('\0').map_or("", |(_, o)| o).to_owned();
                    (owner, num(&kv["create_revision"]), num(&kv["lease"]))
                })
                .collect()
        })
        .unwrap_or_default()
}
