# frozen_string_literal: true

require "net/http"
require "socket"
require "timeout"
require "tmpdir"
require "fileutils"
require_relative "paths"
require_relative "proc_stat"
require_relative "target_ruby"
require_relative "helpers/waiting"

module RubySpyTest
  # A real web server (Debian's Puma) running a fixture app from spec/fixtures, on a free
  # loopback port, with lib/ on its load path; stopped after each example. With
  # RUBYSPY_TARGET_RUBY=NAME:inside the app is made and served inside that chroot, by its own
  # Ruby, Rails and Puma (script/rubies build installs them), as a container would serve it:
  # #pid is still the host's pid of Puma, which the specs record from outside.
  class Server
    include Waiting

    # What a TLS-terminating proxy in front of the app adds to every request it passes on.
    # Rails 7.2's production config forces SSL, answering plain HTTP with a 301 to https; the
    # pprof endpoint is fetched from the app's port directly, in plain HTTP, through the
    # app's config.ssl_options exclusion (spec/fixtures/rails_app/generate).
    PROXY_HEADERS = { "X-Forwarded-Proto" => "https" }.freeze

    attr_reader :pid, :port, :log

    def self.free_port
      server = TCPServer.new("127.0.0.1", 0)
      server.addr[1]
    ensure
      server&.close
    end

    # The headers a client of the app sends for +path+ (see PROXY_HEADERS).
    def self.proxy_headers(path)
      path.start_with?("/debug/pprof") ? {} : PROXY_HEADERS
    end

    # A directory under spec/fixtures: one that holds a +generate+ script is an app made by
    # that script (once per spec run, by the target Ruby) and served through Bundler, as its
    # users would run it; any other holds a config.ru, served with lib/ on the load path.
    # The directory as the target Ruby sees it.
    def self.app_dir(app, ruby = TargetRuby.current)
      fixture = File.join(FIXTURES, app)
      generator = File.join(fixture, "generate")
      return fixture unless File.exist?(generator)

      @generated ||= {}
      @generated[app] ||= begin
        parent, host_parent = ruby.mktmpdir("rbspy-#{app}")
        at_exit { FileUtils.rm_rf(host_parent) }
        dir = File.join(parent, app)
        system(*ruby.command(generator, dir), exception: true)
        dir
      end
    end

    # @param app [String] see {.app_dir}
    def initialize(app, env: {}, ruby: TargetRuby.current)
      raise ArgumentError, "apps are served by the host Ruby or inside a chroot, not #{ruby}" unless ruby.host? || ruby.inside?

      @ruby = ruby
      @dir = Server.app_dir(app, ruby)
      @bundled = File.exist?(ruby.host_path(File.join(@dir, "Gemfile")))
      @port = Server.free_port
      target_tmp, @tmp = ruby.mktmpdir("rbspy-server")
      @log = File.join(@tmp, "puma.log")
      @pidfile = File.join(@tmp, "puma.pid")
      @env = { "PORT" => @port.to_s, "PIDFILE" => File.join(target_tmp, "puma.pid"), "RAILS_ENV" => "production" }
      if ruby.host? # inside, #command says the same with --chdir and -I
        @env[@bundled ? "BUNDLE_GEMFILE" : "RUBYLIB"] = @bundled ? File.join(@dir, "Gemfile") : File.join(ROOT, "lib")
      end
      @env.merge!(env)
    end

    # The Rails version the app was made with (from its Gemfile.lock), nil for an app
    # without Rails.
    def rails_version
      lock = @ruby.host_path(File.join(@dir, "Gemfile.lock"))
      version = File.exist?(lock) && File.read(lock)[/^    railties \((\S+)\)$/, 1]
      version ? Gem::Version.new(version) : nil
    end

    def start
      @pid = Process.spawn(@env, *command, chdir: @ruby.host? ? @dir : ROOT, out: @log, err: @log, pgroup: true)
      wait_for("puma serving", timeout: 60, interval: 0.1, detail: -> { File.read(@log) }) do
        next true if ready?

        raise "puma exited before serving:\n#{File.read(@log)}" if Process.waitpid(@pid, Process::WNOHANG)
      end
      self
    end

    # Puma's worker processes (cluster mode), from /proc.
    def workers
      Dir["/proc/[0-9]*"].filter_map do |dir|
        pid = File.basename(dir).to_i
        pid if RubySpyTest.stat_fields(pid)&.fetch(1).to_i == @pid
      end
    end

    # @param headers [Hash] request headers, e.g. get("/tags", "X-Tenant" => "acme")
    # @param proxied [Boolean] false for a plain request, without {PROXY_HEADERS}
    def get(path, timeout: 30, proxied: true, **headers)
      http = Net::HTTP.new("127.0.0.1", @port)
      http.read_timeout = timeout
      headers = Server.proxy_headers(path).merge(headers) if proxied
      http.get(path, headers.transform_keys(&:to_s))
    end

    # Puma's graceful stop (TERM), ended with KILL if it takes long. It takes well under a
    # second here, but Debian 13's Puma 6.6.0 on Ruby 3.3 now and then never finishes it:
    # its server thread parks for good in IO#close of its notify pipe, racing the buffered
    # write of the stop command into it (puma/puma#3677, fixed by puma/puma#3940).
    def stop
      return unless @pid

      Process.kill(:TERM, -@pid)
      Timeout.timeout(5) { Process.wait(@pid) }
    rescue Timeout::Error
      Process.kill(:KILL, -@pid)
      Process.wait(@pid)
    rescue Errno::ESRCH, Errno::ECHILD
      nil
    ensure
      @pid = nil
      FileUtils.rm_rf(@tmp)
    end

    private

    # Puma, through Bundler for a generated app. Inside a chroot Bundler finds the Gemfile
    # from the working directory (script/rubies drops BUNDLE_GEMFILE with the host's other
    # Ruby settings), and /proc is mounted, since the pprof endpoint reads the app's own
    # memory through it.
    def command
      args = ["-C", File.join(FIXTURES, "puma.rb"), File.join(@dir, "config.ru")]
      return [*(@bundled ? %w[bundle exec puma] : ["puma"]), *args] if @ruby.host?

      ruby_args = @bundled ? %w[-S bundle exec puma] : ["-I", File.join(ROOT, "lib"), "-S", "puma"]
      [File.join(ROOT, "script", "rubies"), "run", @ruby.name, "inside", "--chdir", @dir, "--proc", "--",
       *ruby_args, *args]
    end

    def ready?
      File.exist?(@pidfile) && get("/ping", timeout: 5).code == "200"
    rescue SystemCallError, IOError, Net::ReadTimeout
      false
    end
  end

  # Starts servers that are stopped after the example.
  module ServerHelpers
    def start_server(app, env: {})
      server = Server.new(app, env: env)
      (@servers ||= []) << server # stopped even when it fails to start
      server.start
    end

    def stop_servers
      (@servers || []).each(&:stop)
      @servers = []
    end

    # Keeps +threads+ clients requesting each of +paths+ (round robin) until the block
    # returns; the block's value. Raises if any response's status was not the path's in
    # +statuses+ (200 for a path not there). With +reconnect+ each request comes on a new
    # connection: in Puma's cluster mode a connection stays with the worker that accepted
    # it, so a few kept-alive ones can all land in the same worker.
    # +headers+, when given, is called with each request's path and returns more headers.
    def under_load(server, paths, threads: 3, statuses: {}, reconnect: false, headers: nil)
      stop = false
      failures = Queue.new
      clients = Array.new(threads) do |i|
        Thread.new do
          http = Net::HTTP.start("127.0.0.1", server.port, read_timeout: 30)
          n = i
          until stop
            path = paths[n % paths.size]
            http = http.tap(&:finish).tap(&:start) if reconnect && n > i
            extra = headers ? headers.call(path) : {}
            response = http.get(path, Server.proxy_headers(path).merge(extra))
            failures << "#{path}: #{response.code}" unless response.code == statuses.fetch(path, 200).to_s
            n += 1
          end
          http.finish
        end
      end
      result = yield
      stop = true
      clients.each(&:join)
      raise "requests failed: #{Array.new(failures.size) { failures.pop }.uniq.first(5)}" unless failures.empty?

      result
    ensure
      stop = true
    end
  end
end
