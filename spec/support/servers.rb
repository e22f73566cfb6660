# frozen_string_literal: true

require "net/http"
require "socket"
require "timeout"
require "tmpdir"
require "fileutils"

module RubySpyTest
  # A real web server (Debian's Puma) running a fixture app from spec/fixtures, on a free
  # loopback port, with lib/ on its load path; stopped after each example.
  class Server
    attr_reader :pid, :port, :log

    def self.free_port
      server = TCPServer.new("127.0.0.1", 0)
      server.addr[1]
    ensure
      server&.close
    end

    # A directory under spec/fixtures: one that holds a +generate+ script is an app made by
    # that script (once per spec run) and served through Bundler, as its users would run it;
    # any other holds a config.ru, served with lib/ on the load path.
    def self.app_dir(app)
      fixture = File.join(FIXTURES, app)
      generator = File.join(fixture, "generate")
      return fixture unless File.exist?(generator)

      @generated ||= {}
      @generated[app] ||= begin
        parent = Dir.mktmpdir("rbspy-#{app}")
        at_exit { FileUtils.rm_rf(parent) }
        dir = File.join(parent, app)
        system(RbConfig.ruby, generator, dir, exception: true)
        dir
      end
    end

    # @param app [String] see {.app_dir}
    def initialize(app, env: {})
      @dir = Server.app_dir(app)
      @bundled = File.exist?(File.join(@dir, "Gemfile"))
      @port = Server.free_port
      @tmp = Dir.mktmpdir("rbspy-server")
      @log = File.join(@tmp, "puma.log")
      @pidfile = File.join(@tmp, "puma.pid")
      @env = { "PORT" => @port.to_s, "PIDFILE" => @pidfile, "RAILS_ENV" => "production" }
      @env[@bundled ? "BUNDLE_GEMFILE" : "RUBYLIB"] = @bundled ? File.join(@dir, "Gemfile") : File.join(ROOT, "lib")
      @env.merge!(env)
    end

    def start
      command = ["puma", "-C", File.join(FIXTURES, "puma.rb"), File.join(@dir, "config.ru")]
      command.unshift("bundle", "exec") if @bundled
      @pid = Process.spawn(@env, *command, chdir: @dir, out: @log, err: @log, pgroup: true)
      deadline = Time.now + 60
      until ready?
        raise "puma exited before serving:\n#{File.read(@log)}" if Process.waitpid(@pid, Process::WNOHANG)
        raise "puma not serving after 60 s:\n#{File.read(@log)}" if Time.now > deadline

        sleep 0.1
      end
      self
    end

    # Puma's worker processes (cluster mode), from /proc.
    def workers
      Dir["/proc/[0-9]*/stat"].filter_map do |stat|
        fields = File.read(stat)[/\) (.*)/, 1].to_s.split
        File.basename(File.dirname(stat)).to_i if fields[1].to_i == @pid
      rescue SystemCallError
        nil
      end
    end

    # @param headers [Hash] request headers, e.g. get("/tags", "X-Tenant" => "acme")
    def get(path, timeout: 30, **headers)
      http = Net::HTTP.new("127.0.0.1", @port)
      http.read_timeout = timeout
      http.get(path, headers.transform_keys(&:to_s))
    end

    def stop
      return unless @pid

      Process.kill(:TERM, -@pid)
      Timeout.timeout(20) { Process.wait(@pid) }
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
    def under_load(server, paths, threads: 3, statuses: {}, reconnect: false)
      stop = false
      failures = Queue.new
      clients = Array.new(threads) do |i|
        Thread.new do
          http = Net::HTTP.start("127.0.0.1", server.port, read_timeout: 30)
          n = i
          until stop
            path = paths[n % paths.size]
            http = http.tap(&:finish).tap(&:start) if reconnect && n > i
            response = http.get(path)
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
