//! A `tandem serve` process started by a test: its address, read from the
//! line it prints once listening, and the rest of its stderr.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Spawns `command` (a `tandem serve ... --port 0`, perhaps under mpirun)
/// and waits up to two minutes for it to listen.
pub fn spawn(mut command: Command) -> (Child, SocketAddr, mpsc::Receiver<String>) {
    let mut child = command
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (lines, stderr) = mpsc::channel();
    let pipe = BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in pipe.lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let addr = loop {
        let line = stderr
            .recv_timeout(Duration::from_secs(120))
            .expect("the server did not start");
        if let Some(rest) = line.split_once("http://").map(|(_, r)| r) {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    (child, addr, stderr)
}
