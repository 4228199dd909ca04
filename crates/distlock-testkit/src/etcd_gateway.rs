//! etcd's v3 JSON gateway over plain HTTP/1.1: enough of it (status, put, range) for
//! [`EtcdCluster`](crate::EtcdCluster) to watch elections and prove a cluster serves,
//! without a gRPC client. Keys and values travel base64-encoded, 64-bit numbers as JSON
//! strings.

use std::net::Ipv4Addr;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::error::TestkitError;
use crate::probe::QUERY_TIMEOUT;

const STORE: &str = "etcd";

/// What `/v3/maintenance/status` says of one member.
pub(crate) struct Status {
    /// The answering member's id.
    pub(crate) member: u64,
    /// The leader's id as this member knows it; 0 for none.
    pub(crate) leader: u64,
}

pub(crate) async fn status(port: u16) -> Result<Status, TestkitError> {
    let reply = gateway(port, "/v3/maintenance/status", &json!({})).await?;
    Ok(Status {
        member: json_u64(&reply["header"]["member_id"])
            .ok_or_else(|| malformed("status without header.member_id", &reply))?,
        // Absent, like every zero value, while no leader is known.
        leader: json_u64(&reply["leader"]).unwrap_or(0),
    })
}

pub(crate) async fn put(port: u16, key: &str, value: &str) -> Result<(), TestkitError> {
    let body =
        json!({ "key": base64_encode(key.as_bytes()), "value": base64_encode(value.as_bytes()) });
    gateway(port, "/v3/kv/put", &body).await.map(drop)
}

pub(crate) async fn get(port: u16, key: &str) -> Result<Option<String>, TestkitError> {
    let reply = gateway(
        port,
        "/v3/kv/range",
        &json!({ "key": base64_encode(key.as_bytes()) }),
    )
    .await?;
    let Some(kv) = reply["kvs"].as_array().and_then(|kvs| kvs.first()) else {
        return Ok(None);
    };
    // An empty value is left out of the JSON, like every zero value.
    let encoded = kv["value"].as_str().unwrap_or("");
    let bytes = base64_decode(encoded).ok_or_else(|| malformed("value not base64", &reply))?;
    Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
}

fn malformed(what: &str, reply: &Value) -> TestkitError {
    TestkitError::Store {
        store: STORE,
        what: format!("unexpected gateway reply: {what}: {reply}"),
        output: String::new(),
    }
}

/// The gateway writes 64-bit numbers as JSON strings.
fn json_u64(value: &Value) -> Option<u64> {
    match value {
        Value::String(text) => text.parse().ok(),
        other => other.as_u64(),
    }
}

/// `POST path` with a JSON body to the v3 JSON gateway on `port`, bounded by the query
/// timeout (a frozen member accepts the connection but never answers).
async fn gateway(port: u16, path: &str, body: &Value) -> Result<Value, TestkitError> {
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let exchange = async {
        let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await?;
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(QUERY_TIMEOUT, exchange)
        .await
        .map_err(|_| TestkitError::Timeout {
            what: format!("an answer to {path} from port {port}"),
            waited: QUERY_TIMEOUT,
            last: "no reply (is the member frozen?)".to_owned(),
        })?
        .map_err(TestkitError::io(format!("{path} on port {port}")))?;
    let (code, body) = parse_http(&response).ok_or_else(|| TestkitError::Store {
        store: STORE,
        what: format!("{path} on port {port}: not an HTTP response"),
        output: String::from_utf8_lossy(&response).into_owned(),
    })?;
    if code != 200 {
        return Err(TestkitError::Store {
            store: STORE,
            what: format!("{path} on port {port}: HTTP {code}"),
            output: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    serde_json::from_slice(&body).map_err(|err| TestkitError::Store {
        store: STORE,
        what: format!("{path} on port {port}: invalid JSON ({err})"),
        output: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// The status code and body of a whole HTTP/1.1 response (read to the connection's end),
/// undoing chunked transfer encoding.
fn parse_http(response: &[u8]) -> Option<(u16, Vec<u8>)> {
    let split = response
        .windows(4)
        .position(|window| window == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&response[..split]).ok()?;
    let body = &response[split + 4..];
    let mut lines = head.split("\r\n");
    let code = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let chunked = lines.any(|line| {
        let line = line.to_ascii_lowercase();
        line.starts_with("transfer-encoding:") && line.contains("chunked")
    });
    if !chunked {
        return Some((code, body.to_vec()));
    }
    let mut rest = body;
    let mut decoded = Vec::new();
    loop {
        let end = rest.windows(2).position(|window| window == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[..end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[end + 2..];
        if size == 0 {
            return Some((code, decoded));
        }
        decoded.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}

const BASE64: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// Standard base64 with padding, as the gateway wants bytes.
fn base64_encode(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (i, shift) in [18u32, 12, 6, 0].into_iter().enumerate() {
            if i <= chunk.len() {
                out.push(char::from(BASE64[((n >> shift) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let digits: Vec<u32> = text
        .trim_end_matches('=')
        .bytes()
        .map(|byte| BASE64.iter().position(|&d| d == byte).map(|d| d as u32))
        .collect::<Option<_>>()?;
    let mut out = Vec::with_capacity(digits.len() * 3 / 4);
    for chunk in digits.chunks(4) {
        if chunk.len() == 1 {
            return None;
        }
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, d)| n | (d << (18 - 6 * i as u32)));
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..chunk.len() - 1]);
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for (plain, encoded) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("distlock-testkit/ready", "ZGlzdGxvY2stdGVzdGtpdC9yZWFkeQ=="),
        ] {
            assert_eq!(base64_encode(plain.as_bytes()), encoded);
            assert_eq!(base64_decode(encoded).as_deref(), Some(plain.as_bytes()));
        }
        assert_eq!(base64_decode("Z"), None);
        assert_eq!(base64_decode("Z!=="), None);
    }

    #[test]
    fn parses_plain_and_chunked_responses() {
        let plain = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}";
        assert_eq!(parse_http(plain), Some((200, b"{}".to_vec())));
        let chunked =
            b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n";
        assert_eq!(parse_http(chunked), Some((503, b"{\"a\":1}".to_vec())));
        assert_eq!(parse_http(b"garbage"), None);
    }

    #[test]
    fn reads_gateway_numbers_as_strings_or_numbers() {
        assert_eq!(json_u64(&json!("18446744073709551615")), Some(u64::MAX));
        assert_eq!(json_u64(&json!(7)), Some(7));
        assert_eq!(json_u64(&Value::Null), None);
    }
}
