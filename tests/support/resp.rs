//! A tiny blocking RESP2 client: enough to send one command and read one reply,
//! so tests can look at Redis without going through the crate under test.

use std::io::{self, BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RespValue {
    /// `+OK`
    Simple(String),
    /// `-ERR ...`
    Error(String),
    /// `:42`
    Integer(i64),
    /// `$3\r\nabc` (bytes as sent by the server)
    Bulk(Vec<u8>),
    /// `$-1` or `*-1`
    Nil,
    /// `*N ...`
    Array(Vec<RespValue>),
}

impl RespValue {
    /// The text of a simple string, or of a bulk string that is valid UTF-8.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            RespValue::Simple(s) => Some(s),
            RespValue::Bulk(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    /// The text of a simple or bulk string (bulk decoded lossily).
    pub fn to_string_lossy(&self) -> Option<String> {
        match self {
            RespValue::Simple(s) => Some(s.clone()),
            RespValue::Bulk(b) => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        }
    }

    pub fn as_int(&self) -> Option<i64> {
        match self {
            RespValue::Integer(i) => Some(*i),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[RespValue]> {
        match self {
            RespValue::Array(items) => Some(items),
            _ => None,
        }
    }

    /// `true` for the simple string `OK`.
    pub fn is_ok(&self) -> bool {
        matches!(self, RespValue::Simple(s) if s == "OK")
    }

    pub fn is_error(&self) -> bool {
        matches!(self, RespValue::Error(_))
    }

    pub fn is_nil(&self) -> bool {
        matches!(self, RespValue::Nil)
    }
}

/// Encodes one command as a RESP array of bulk strings.
pub fn encode_command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + args.iter().map(|a| a.len() + 16).sum::<usize>());
    out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
    for arg in args {
        out.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        out.extend_from_slice(arg);
        out.extend_from_slice(b"\r\n");
    }
    out
}

fn protocol_error(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn read_line<R: BufRead>(r: &mut R) -> io::Result<String> {
    let mut buf = Vec::new();
    r.read_until(b'\n', &mut buf)?;
    if buf.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed by redis-server",
        ));
    }
    if !buf.ends_with(b"\r\n") {
        return Err(protocol_error(format!(
            "RESP line not terminated by CRLF: {:?}",
            String::from_utf8_lossy(&buf)
        )));
    }
    buf.truncate(buf.len() - 2);
    String::from_utf8(buf).map_err(|e| protocol_error(format!("RESP line not UTF-8: {e}")))
}

fn parse_len(s: &str) -> io::Result<i64> {
    s.parse::<i64>()
        .map_err(|_| protocol_error(format!("bad RESP length/integer {s:?}")))
}

/// Reads one complete RESP2 value.
pub fn read_value<R: BufRead>(r: &mut R) -> io::Result<RespValue> {
    let line = read_line(r)?;
    let (kind, rest) = line.split_at(line.chars().next().map_or(0, char::len_utf8));
    match kind {
        "+" => Ok(RespValue::Simple(rest.to_owned())),
        "-" => Ok(RespValue::Error(rest.to_owned())),
        ":" => Ok(RespValue::Integer(parse_len(rest)?)),
        "$" => {
            let len = parse_len(rest)?;
            if len < 0 {
                return Ok(RespValue::Nil);
            }
            let mut data = vec![0u8; len as usize + 2];
            r.read_exact(&mut data)?;
            if !data.ends_with(b"\r\n") {
                return Err(protocol_error("bulk string not terminated by CRLF"));
            }
            data.truncate(len as usize);
            Ok(RespValue::Bulk(data))
        }
        "*" => {
            let len = parse_len(rest)?;
            if len < 0 {
                return Ok(RespValue::Nil);
            }
            let mut items = Vec::with_capacity(len as usize);
            for _ in 0..len {
                items.push(read_value(r)?);
            }
            Ok(RespValue::Array(items))
        }
        _ => Err(protocol_error(format!("unknown RESP reply {line:?}"))),
    }
}

/// One short-lived blocking connection.
pub struct Connection {
    reader: BufReader<TcpStream>,
}

impl Connection {
    /// Connects with `timeout` for the connect itself and for every read/write.
    pub fn open(addr: SocketAddr, timeout: Duration) -> io::Result<Connection> {
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        stream.set_nodelay(true)?;
        Ok(Connection {
            reader: BufReader::new(stream),
        })
    }

    /// Sends one command and reads its reply. A Redis error reply is `Ok(RespValue::Error)`.
    pub fn call(&mut self, args: &[&[u8]]) -> io::Result<RespValue> {
        self.reader.get_mut().write_all(&encode_command(args))?;
        read_value(&mut self.reader)
    }

    /// Reads the next message the server pushes (a subscription's, after `SUBSCRIBE`).
    pub fn read(&mut self) -> io::Result<RespValue> {
        read_value(&mut self.reader)
    }

    /// Like [`Connection::call`] with string arguments.
    pub fn call_str(&mut self, args: &[&str]) -> io::Result<RespValue> {
        let args: Vec<&[u8]> = args.iter().map(|a| a.as_bytes()).collect();
        self.call(&args)
    }
}
