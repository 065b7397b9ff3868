//! What the kernel says of this process's own connections: the test of a socket option
//! the crate sets, read back from the socket rather than from the crate.

use std::mem::ManuallyDrop;
use std::net::TcpStream;
use std::os::fd::FromRawFd;

/// `TCP_NODELAY` of every TCP connection this process holds to a loopback `port`, one
/// entry per connection (Linux: the sockets among `/proc/self/fd`). Tests of one binary
/// share the process; their servers' ports are their own.
pub fn nodelay_to(port: u16) -> Vec<bool> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd") {
        let Ok(entry) = entry else { continue };
        let is_socket = std::fs::read_link(entry.path())
            .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"));
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if !is_socket {
            continue;
        }
        // SAFETY: `fd` named an open socket a moment ago, and the stream is never
        // dropped, so it is never closed here. Should another thread close the socket
        // and the number be reused meanwhile, the two read-only calls below fail or
        // describe another descriptor, which the port check skips.
        #[allow(unsafe_code)]
        let stream = ManuallyDrop::new(unsafe { TcpStream::from_raw_fd(fd) });
        let ours = stream
            .peer_addr()
            .is_ok_and(|peer| peer.ip().is_loopback() && peer.port() == port);
        if let (true, Ok(nodelay)) = (ours, stream.nodelay()) {
            found.push(nodelay);
        }
    }
    found
}
