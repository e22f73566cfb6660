//! `RubySpy::NativeServer`: a thin wrapper over the core's pprof listener (core/src/serve),
//! which runs on native threads of its own and never calls into Ruby. The Ruby API (options,
//! the environment variable, docs) is lib/rbspy_ext/server.rb.
use crate::guard::{guarded, Gvl};
use crate::{errors, nogvl::nogvl};
use magnus::{function, method, prelude::*, Error, Ruby};
use rbspy_ext_core::serve::{ServeConfig, Server};
use std::net::ToSocketAddrs;
use std::sync::Mutex;

#[magnus::wrap(class = "RubySpy::NativeServer", free_immediately, size)]
struct NativeServer(Mutex<Option<Server>>);

impl NativeServer {
    /// `NativeServer.start(bind, port, token, loopback, subprocesses)`, validated by
    /// lib/rbspy_ext/server.rb; the core refuses an open address without a token.
    fn start(
        ruby: &Ruby,
        bind: String,
        port: u16,
        token: Option<String>,
        loopback: bool,
        subprocesses: bool,
    ) -> Result<Self, Error> {
        let addr = (bind.as_str(), port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                Error::new(
                    ruby.exception_arg_error(),
                    format!("cannot resolve bind address {bind:?}: give an IP such as 127.0.0.1"),
                )
            })?;
        let config = ServeConfig {
            addr,
            token,
            loopback,
            pid: std::process::id() as i32,
            subprocesses,
        };
        let server = guarded(ruby, Gvl::Keep, "starting the pprof listener", || {
            Server::start(config)
        })?;
        Ok(NativeServer(Mutex::new(Some(server))))
    }

    /// The port listened on (the one the system chose, for port 0); nil once stopped.
    fn port(&self) -> Option<u16> {
        let server = self.0.lock().ok()?;
        server
            .as_ref()
            .filter(|s| s.running())
            .map(|s| s.addr().port())
    }

    fn running(&self) -> bool {
        self.port().is_some()
    }

    /// Closes the port; waits (without the GVL) for the accepting thread, up to 0.1 s.
    fn stop(ruby: &Ruby, rb_self: &Self) -> Result<(), Error> {
        let server = rb_self.0.lock().ok().and_then(|mut s| s.take());
        if let Some(mut server) = server {
            nogvl(move || server.stop())
                .map_err(|_| errors::panicked(ruby, "stopping the pprof listener"))?;
        }
        Ok(())
    }
}

pub fn init(ruby: &Ruby) -> Result<(), Error> {
    let module = ruby.define_module("RubySpy")?;
    let class = module.define_class("NativeServer", ruby.class_object())?;
    class.define_singleton_method("start", function!(NativeServer::start, 5))?;
    class.define_method("port", method!(NativeServer::port, 0))?;
    class.define_method("running?", method!(NativeServer::running, 0))?;
    class.define_method("stop", method!(NativeServer::stop, 0))?;
    crate::classes::resolve::<NativeServer>(ruby);
    Ok(())
}
