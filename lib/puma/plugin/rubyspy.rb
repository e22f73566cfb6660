# frozen_string_literal: true

require "puma/plugin"
# The listener alone, not all of rbspy_ext: the app (and Rails, whose Railtie rbspy_ext
# defines only when Rails is loaded first) is loaded after this, in the workers.
require "rbspy_ext/server"

# +plugin :rubyspy+ in config/puma.rb: a pprof listener of its own in Puma's master
# ({RubySpy::Server}), so one scrape records the master and every worker (each sample
# labelled with its +pid+ and +worker+), whichever worker is busy or stuck, and workers that
# restart or are added during a scrape are picked up. In single mode it records the one
# process.
#
# The address is +RUBYSPY_PPROF+ ("127.0.0.1:6060" when unset) and the token
# +RUBYSPY_PPROF_TOKEN+ (needed for any address but loopback). Workers are forked from the
# master: they close the listening socket at fork and start no listener of their own.
Puma::Plugin.create do
  # Called by Puma in the master, before it boots or forks anything.
  # @param launcher [Puma::Launcher]
  def start(launcher)
    log = launcher.respond_to?(:log_writer) ? launcher.log_writer : launcher.events
    server = RubySpy::Server.current || begin
      bind, port = RubySpy::Server.parse_address(ENV.fetch(RubySpy::Server::ENV_ADDRESS, "127.0.0.1:6060"))
      RubySpy::Server.start(bind: bind, port: port, token: ENV[RubySpy::Server::ENV_TOKEN])
    end
    log.log "* rbspy_ext pprof listener on #{server.url} (pid #{Process.pid} and its workers)"
  rescue RubySpy::Error, ArgumentError => e
    log.log "! rbspy_ext pprof listener not started: #{e.message}"
  end
end
