//! A minimal HTTP/1.1 client for the server tests: one request per connection
//! (`Connection: close`), content-length or chunked bodies, and server-sent events.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// A response: status and de-chunked body.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: String,
}

impl Response {
    /// The body as JSON (panics with the body when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of a server-sent-event body, in order.
    pub fn events(&self) -> Vec<String> {
        self.body
            .split("\n\n")
            .filter_map(|block| {
                let data: Vec<&str> = block
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
                    .collect();
                (!data.is_empty()).then(|| data.join("\n"))
            })
            .collect()
    }
}

/// Opens a connection and sends `method path` with `body` (JSON content type).
pub fn send(addr: &str, method: &str, path: &str, body: &[u8]) -> BufReader<TcpStream> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    // A server may answer (413) before reading all of an oversized body.
    let _ = s.write_all(body);
    BufReader::new(s)
}

/// Reads the status line and headers; returns (status, chunked, content length).
pub fn read_head(r: &mut BufReader<TcpStream>) -> (u16, bool, Option<usize>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .unwrap_or_else(|| panic!("bad status line {line:?}"))
        .parse()
        .unwrap();
    let (mut chunked, mut len) = (false, None);
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let lower = l.to_ascii_lowercase();
        if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        }
        if let Some(v) = lower.strip_prefix("content-length:") {
            len = v.trim().parse().ok();
        }
    }
    (status, chunked, len)
}

/// Reads the next chunk of a chunked body (`None` at the end).
pub fn read_chunk(r: &mut BufReader<TcpStream>) -> Option<Vec<u8>> {
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let n = usize::from_str_radix(line.trim(), 16).ok()?;
    let mut buf = vec![0; n + 2];
    r.read_exact(&mut buf).ok()?;
    buf.truncate(n);
    (n > 0).then_some(buf)
}

/// A whole request and response.
pub fn request(addr: &str, method: &str, path: &str, body: &str) -> Response {
    read_response(send(addr, method, path, body.as_bytes()))
}

/// A whole response from `r`.
pub fn read_response(mut r: BufReader<TcpStream>) -> Response {
    let (status, chunked, len) = read_head(&mut r);
    let mut bytes = Vec::new();
    if chunked {
        while let Some(c) = read_chunk(&mut r) {
            bytes.extend(c);
        }
    } else if let Some(n) = len {
        bytes.resize(n, 0);
        r.read_exact(&mut bytes).unwrap();
    } else {
        r.read_to_end(&mut bytes).unwrap();
    }
    Response {
        status,
        body: String::from_utf8(bytes).unwrap(),
    }
}

/// `POST path` with a JSON body.
pub fn post(addr: &str, path: &str, body: &serde_json::Value) -> Response {
    request(addr, "POST", path, &body.to_string())
}

/// `GET path`.
pub fn get(addr: &str, path: &str) -> Response {
    request(addr, "GET", path, "")
}
