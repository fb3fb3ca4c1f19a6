//! `kakeya serve` facing an open network, on a tiny model over an ephemeral loopback port:
//! half-sent requests and idle connections closed after the header timeout, a stalled body
//! answered 408; a flood of idle connections past the process's file limit does not stop a
//! well-formed request from being served within that timeout; a client that stops reading a
//! stream frees its sequence; API keys missing, wrong, right and from a file; a TLS round trip
//! with a self-signed certificate (`tests/fixtures/tls/`).

mod common;

use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use common::http::{self, get, read_head};
use common::server::{Server, tiny};
use kakeya_models::testing::Scratch;
use serde_json::json;

/// Reads until the server closes `s` (or `limit` passes): whether it closed, and what it sent.
fn closed_within(s: &mut TcpStream, limit: Duration) -> (bool, String) {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let closed = s.read_to_end(&mut got).is_ok();
    (closed, String::from_utf8_lossy(&got).into_owned())
}

#[test]
fn half_sent_and_idle_connections_are_closed_and_a_stalled_body_gets_408() {
    let s = Scratch::new("serve-timeouts");
    let (m, _) = tiny(&s);
    let srv = Server::start(
        &m,
        &[
            "--no-drafter",
            "--header-timeout-secs",
            "1",
            "--body-timeout-secs",
            "1",
        ],
    );
    let t0 = Instant::now();
    // Half a head; nothing at all; a whole request, then nothing on the kept-alive connection.
    let mut half = TcpStream::connect(&srv.addr).unwrap();
    half.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .unwrap();
    let mut silent = TcpStream::connect(&srv.addr).unwrap();
    let mut kept = TcpStream::connect(&srv.addr).unwrap();
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    for (name, conn) in [
        ("half", &mut half),
        ("silent", &mut silent),
        ("kept", &mut kept),
    ] {
        let (closed, got) = closed_within(conn, Duration::from_secs(10));
        assert!(closed, "{name}: still open after {:?}", t0.elapsed());
        if name == "kept" {
            assert!(got.starts_with("HTTP/1.1 200"), "{got}");
        }
    }
    assert!(t0.elapsed() < Duration::from_secs(8), "{:?}", t0.elapsed());
    // A body that stops short of its length: 408 in OpenAI's shape.
    let mut body = TcpStream::connect(&srv.addr).unwrap();
    body.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":",
    )
    .unwrap();
    let (_, got) = closed_within(&mut body, Duration::from_secs(10));
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("\"invalid_request_error\""), "{got}");
    // And the server still serves.
    assert_eq!(get(&srv.addr, "/health").status, 200);
}

#[test]
fn idle_connections_past_the_file_limit_do_not_lock_out_a_request() {
    let s = Scratch::new("serve-flood");
    let (m, _) = tiny(&s);
    // The process may open 160 files: at most 96 connections.
    let mut cmd = Command::new("bash");
    cmd.args(["-c", "ulimit -n 160 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_kakeya"))
        .args([
            "serve",
            "--model",
            m.to_str().unwrap(),
            "--port",
            "0",
            "--no-drafter",
        ])
        .args(["--header-timeout-secs", "2"]);
    let srv = Server::spawn(cmd, "http");
    let addr = srv.addr.clone();
    // 300 idle connections: past the cap and past the file limit.
    let flood: Vec<TcpStream> = (0..300)
        .filter_map(|_| TcpStream::connect(&addr).ok())
        .collect();
    assert!(flood.len() > 100, "{} connections opened", flood.len());
    let t0 = Instant::now();
    let body = json!({"prompt": "w1 w2", "max_tokens": 4, "temperature": 0}).to_string();
    let served = loop {
        let r = std::panic::catch_unwind(|| http::request(&addr, "POST", "/v1/completions", &body));
        match r {
            Ok(r) if r.status == 200 => break t0.elapsed(),
            Ok(r) => assert_eq!(r.status, 503, "{}", r.body),
            Err(_) => {} // refused or reset while descriptors ran out
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "not served");
        std::thread::sleep(Duration::from_millis(100));
    };
    // Within the header timeout of the idle ones (2 s), plus slack for a loaded machine.
    assert!(served < Duration::from_secs(8), "served after {served:?}");
    drop(flood);
    assert_eq!(get(&addr, "/health").status, 200);
}

#[test]
fn a_client_that_stops_reading_a_stream_frees_its_sequence() {
    let s = Scratch::new("serve-stall");
    let (m, _) = tiny(&s);
    // A long model name makes every chunk ~100 KB, and the client's receive buffer is small:
    // the socket buffers fill within the first chunks, long before the answer's end.
    let name = "m".repeat(100_000);
    let srv = Server::start(
        &m,
        &[
            "--no-drafter",
            "--stall-timeout-secs",
            "0.02",
            "--model-name",
            &name,
        ],
    );
    let body = json!({"prompt": "w1 w2", "max_tokens": 480, "ignore_eos": true, "stream": true})
        .to_string();
    let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    sock.set_recv_buffer_size(4096).unwrap();
    let addr: std::net::SocketAddr = srv.addr.parse().unwrap();
    sock.connect(&addr.into()).unwrap();
    let mut stream: TcpStream = sock.into();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut r = BufReader::new(stream);
    let (status, _, _) = read_head(&mut r);
    assert_eq!(status, 200);
    // Read nothing more: the sequence must end (cancelled) and free its slot.
    srv.wait_metric("kakeya_sequences_cancelled_total", 1.0);
    srv.wait_metric("kakeya_running_sequences", 0.0);
    drop(r);
    let ok = srv.post(
        "/v1/completions",
        &json!({"prompt": "w1", "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
}

/// A request with `Authorization: Bearer key` when given.
fn authorized(addr: &str, path: &str, key: Option<&str>) -> http::Response {
    let mut s = TcpStream::connect(addr).unwrap();
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    let body = json!({"prompt": "w1", "max_tokens": 2, "temperature": 0}).to_string();
    let (method, len) = if path == "/v1/completions" {
        ("POST", body.len())
    } else {
        ("GET", 0)
    };
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    if len > 0 {
        s.write_all(body.as_bytes()).unwrap();
    }
    http::read_response(BufReader::new(s))
}

#[test]
fn api_keys_missing_wrong_right_and_from_a_file() {
    let s = Scratch::new("serve-keys");
    let (m, _) = tiny(&s);
    let file = s.0.join("keys.txt");
    std::fs::write(&file, "# the team's keys\nsk-from-file\n\n").unwrap();
    let srv = Server::start(
        &m,
        &[
            "--no-drafter",
            "--api-key",
            "sk-given",
            "--api-key-file",
            file.to_str().unwrap(),
        ],
    );
    for path in ["/v1/completions", "/v1/models", "/metrics"] {
        for (key, want) in [
            (None, 401),
            (Some("sk-wrong"), 401),
            (Some("sk-given"), 200),
            (Some("sk-from-file"), 200),
        ] {
            let r = authorized(&srv.addr, path, key);
            assert_eq!(r.status, want, "{path} with {key:?}: {}", r.body);
            if want == 401 {
                assert_eq!(r.json()["error"]["code"], "invalid_api_key", "{}", r.body);
            }
        }
    }
    assert_eq!(authorized(&srv.addr, "/health", None).status, 200);
    // No key ever reaches the log.
    let logged: Vec<String> = srv.stderr.try_iter().collect();
    assert!(
        logged
            .iter()
            .all(|l| !l.contains("sk-given") && !l.contains("sk-from-file")),
        "{logged:?}"
    );
    // `/metrics` left open.
    let open = Server::start(&m, &["--no-drafter", "--api-key", "k", "--open-metrics"]);
    assert_eq!(authorized(&open.addr, "/metrics", None).status, 200);
    assert_eq!(authorized(&open.addr, "/v1/models", None).status, 401);
    // A key file that cannot be read, or holds no key: a clear error, no server.
    let empty = s.0.join("empty.txt");
    std::fs::write(&empty, "# nothing\n").unwrap();
    for (f, why) in [
        (s.0.join("missing.txt"), "cannot read it"),
        (empty, "no key in it"),
    ] {
        let err = common::fails(&[
            "serve",
            "--model",
            m.to_str().unwrap(),
            "--api-key-file",
            f.to_str().unwrap(),
        ]);
        assert!(
            err.contains(why) && err.contains(f.to_str().unwrap()),
            "{err}"
        );
    }
}

#[test]
fn a_tls_round_trip_with_a_self_signed_certificate() {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, ServerName};
    let s = Scratch::new("serve-tls");
    let (m, _) = tiny(&s);
    let fixtures =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tls");
    let (cert, key) = (fixtures.join("cert.pem"), fixtures.join("key.pem"));
    let mut cmd = common::kakeya();
    cmd.args([
        "serve",
        "--model",
        m.to_str().unwrap(),
        "--port",
        "0",
        "--no-drafter",
    ])
    .args([
        "--ssl-cert-file",
        cert.to_str().unwrap(),
        "--ssl-key-file",
        key.to_str().unwrap(),
    ]);
    let srv = Server::spawn(cmd, "https");
    let addr = srv.addr.clone();
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(&cert).unwrap())
        .unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let conn = rustls::ClientConnection::new(
        std::sync::Arc::new(config),
        ServerName::try_from("localhost").unwrap(),
    )
    .unwrap();
    let tcp = TcpStream::connect(&addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let body = json!({"prompt": "w1 w2", "max_tokens": 3, "temperature": 0}).to_string();
    write!(
        tls,
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut reply = String::new();
    let _ = tls.read_to_string(&mut reply);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.contains("\"text_completion\""), "{reply}");
    // Plain HTTP on the TLS port gets no answer.
    let mut plain = TcpStream::connect(&addr).unwrap();
    plain
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let (_, got) = closed_within(&mut plain, Duration::from_secs(10));
    assert!(!got.contains("200"), "{got}");
    drop(srv);
    // A key that is not a key: a clear error naming the file.
    let e = common::fails(&[
        "serve",
        "--model",
        m.to_str().unwrap(),
        "--ssl-cert-file",
        cert.to_str().unwrap(),
        "--ssl-key-file",
        cert.to_str().unwrap(),
    ]);
    assert!(
        e.contains("not a PEM private key") && e.contains("cert.pem"),
        "{e}"
    );
}
