# frozen_string_literal: true

require "json"
require "open3"
require "tmpdir"
require "fileutils"
require "timeout"

module RubySpyTest
  # The Firefox Profiler's own CLI, `pq` (npm's @firefox-devtools/profiler-cli), which loads a
  # file with the profiler's code: its upgraders, its processing, its call tree and marker
  # tables. script/setup installs it, and the Node 24 it needs, under
  # ~/.cache/rbspy_ext/profiler-cli. pq keeps the profile in a daemon between commands; each
  # instance here has a session directory of its own, so runs side by side never meet.
  class ProfilerCli
    DIR = File.join(ENV.fetch("XDG_CACHE_HOME", File.join(Dir.home, ".cache")), "rbspy_ext", "profiler-cli")
    BIN = File.join(DIR, "node_modules", ".bin")
    # A command of pq's, loading included, answers in seconds; past this it is stuck.
    TIMEOUT = 120

    def self.available?
      File.executable?(File.join(BIN, "pq")) && File.executable?(File.join(BIN, "node"))
    end

    # Loads +path+ (a firefox file) in a new session; the block's value, the session stopped
    # after it. Without a block the caller calls #stop.
    def self.open(path)
      cli = new(path)
      return cli unless block_given?

      begin
        yield cli
      ensure
        cli.stop
      end
    end

    # Seconds `pq load` took.
    attr_reader :load_seconds

    def initialize(path)
      @sessions = Dir.mktmpdir("pq-sessions")
      @env = { "PATH" => "#{BIN}:#{ENV.fetch('PATH', '')}", "PROFILER_CLI_SESSION_DIR" => @sessions }
      started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      load(path)
      @load_seconds = Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
    end

    # pq waits 500 ms for the daemon it starts, and on a busy machine (CI's lanes beside a
    # build) the daemon may take longer: pq then says so, names its pid and suggests a retry.
    # That daemon is stopped and the load tried again, up to 3 times.
    def load(path, attempts: 3)
      run("load", path)
    rescue RuntimeError => e
      stuck = e.message[/did not become ready within.*?run "kill (\d+)"/m, 1]
      raise unless stuck && attempts > 1

      begin
        Process.kill(:KILL, Integer(stuck))
      rescue Errno::ESRCH
        nil # it ended meanwhile
      end
      load(path, attempts: attempts - 1)
    end

    # pq's output of +args+ as text; raises with its output when it fails.
    def run(*args)
      out, status = Timeout.timeout(TIMEOUT) { Open3.capture2e(@env, "pq", *args.map(&:to_s)) }
      raise "pq #{args.join(' ')} failed (#{status}):\n#{out}" unless status.success?

      out
    end

    # pq's answer to +args+ with --json, parsed.
    def json(*args)
      JSON.parse(run(*args, "--json"))
    end

    # Every thread pq lists: {handle => name}.
    def threads
      json("profile", "info", "--all").fetch("processes").flat_map { |p| p.fetch("threads") }
                                       .to_h { |t| [t.fetch("threadHandle"), t.fetch("name")] }
    end

    # Thread +handle+'s functions by self samples, idle samples (blocked threads) included as
    # our summary counts them: {name => self samples}.
    def self_samples(handle)
      json("thread", "samples", "--thread", handle, "--include-idle", "--limit", "0")
        .fetch("topFunctionsBySelf").to_h { |f| [f.fetch("name"), f.fetch("selfSamples")] }
    end

    # Thread +handle+'s markers in time order, as pq lists them: each a Hash with "name",
    # "start" and "duration" (ms), "category", "markerType" and "data" (our fields).
    def markers(handle)
      json("thread", "markers", "--thread", handle, "--list", "--limit", "0").fetch("flatMarkers")
    end

    def stop
      Open3.capture2e(@env, "pq", "stop", "--all") if @sessions
    rescue StandardError
      nil
    ensure
      FileUtils.rm_rf(@sessions) if @sessions
      @sessions = nil
    end
  end
end
