# frozen_string_literal: true

require "fileutils"
require "json"
require_relative "paths"
require_relative "proc_stat"
require_relative "target_ruby"
require_relative "helpers/waiting"

module RubySpyTest
  # One frame of the ground truth a fixture recorded from Ruby's own backtrace_locations.
  ExpectedFrame = Struct.new(:label, :base_label, :path, :absolute_path, :lineno,
                             keyword_init: true) do
    def to_s
      "#{path}:#{lineno}:in '#{label}'"
    end
  end

  # A fixture script running in its own process:
  #
  #   RbConfig.ruby --disable-gems spec/fixtures/NAME.rb READY_PATH [ARGS...]
  #
  # run from the repository root (so the main script's path is relative, like in real use)
  # with its output in a private temporary directory. #start returns once the fixture has
  # written its ready file (see spec/fixtures/lib/park.rb) and is settled in the state the
  # file describes.
  #
  # RubyGems is left out unless the fixture's header has the line RUBYGEMS_MARK (a fixture
  # that loads a gem, or one whose stack goes through RubyGems' own `require`): loading it is
  # a tenth of a second of CPU per start, and the suites start some 200 fixtures per Ruby
  # (issue 47: CI's time is CPU time on this machine).
  class Target
    include Waiting

    READY_TIMEOUT = 15 # seconds
    RUBYGEMS_MARK = "# rbspy-test: rubygems"
    POLL_INTERVAL = 0.01 # seconds

    attr_reader :name, :args, :pid, :dir, :ready_path, :log_path, :ruby_version, :frames,
                :info, :document

    # Spawns and waits. With stdio: true the fixture's stdin and stdout are pipes to the
    # spec (#ping talks through them); otherwise both go to the log file. +env+ is added to
    # the fixture's environment (for settings Ruby reads at boot, like RUBY_MN_THREADS).
    def self.start(name, *args, stdio: false, env: {}, ruby: TargetRuby.current)
      target = new(name, *args, stdio: stdio, env: env, ruby: ruby)
      target.spawn
      target.wait_until_ready
      target
    rescue Exception
      target&.stop
      raise
    end

    # +ruby+: what runs the fixture (a TargetRuby, or anything with #command and #mktmpdir).
    def initialize(name, *args, stdio: false, env: {}, ruby: TargetRuby.current)
      @ruby = ruby
      @name = name
      @args = args
      @stdio = stdio
      # A TargetRuby's own settings (RUBY_MN_THREADS for :mn=N) first: a spec's win.
      @env = (ruby.respond_to?(:env) ? ruby.env : {}).merge(env)
      @status = nil
    end

    def script
      File.join("spec", "fixtures", "#{name}.rb")
    end

    def spawn
      raise ArgumentError, "no fixture #{script}" unless File.file?(File.join(ROOT, script))

      ruby = @ruby
      target_dir, @dir = ruby.mktmpdir("rbspy-#{name}-")
      @ready_path = File.join(@dir, "ready.json")
      target_ready_path = File.join(target_dir, "ready.json")
      @log_path = File.join(@dir, "output.log")
      options = { chdir: ROOT, err: [@log_path, "w"] }
      if @stdio
        child_in, @stdin = IO.pipe
        @stdout, child_out = IO.pipe
        options[:in] = child_in
        options[:out] = child_out
      else
        options[:in] = File::NULL
        options[:out] = [:child, :err]
      end
      @pid = Process.spawn(@env, *ruby.command(*ruby_options, script, target_ready_path, *args), options)
      self
    ensure
      child_in&.close
      child_out&.close
    end

    # Ruby's options before the script: see RUBYGEMS_MARK.
    def ruby_options
      header = File.foreach(File.join(ROOT, script)).first(40)
      header.any? { |line| line.start_with?(RUBYGEMS_MARK) } ? [] : ["--disable-gems"]
    end

    def wait_until_ready
      deadline = monotonic + READY_TIMEOUT
      wait_for("fixture #{script} (pid #{pid}) to write its ready file",
               timeout: READY_TIMEOUT, interval: POLL_INTERVAL, detail: -> { its_output }) do
        next true if File.exist?(@ready_path)

        reap_nonblocking
        fail_startup("exited (#{@status.inspect}) before writing its ready file") if @status
      end
      load_ready_file
      settle(deadline)
      self
    end

    # True while the process exists and has not been reaped (a zombie counts as gone).
    def alive?
      reap_nonblocking
      return false if @status

      state = RubySpyTest.process_state(pid)
      !state.nil? && state != "Z" && state != "X"
    end

    # Everything that looks wrong with the process, empty when it is running normally: it
    # exists, is not stopped or traced, and (for stdio targets) still answers a ping.
    def health_problems
      return ["process #{pid} is gone (#{@status.inspect})"] unless alive?

      problems = RubySpyTest.process_problems(pid)
      if @stdio && problems.empty?
        begin
          token = "#{Process.pid}-#{rand(1_000_000)}"
          answer = ping(token)
          problems << "process #{pid} answered #{answer.inspect} to ping #{token}" unless answer == "pong #{token}"
        rescue StandardError => e
          problems << "process #{pid} did not answer a ping: #{e.class}: #{e.message}"
        end
      end
      problems
    end

    # After #kill!: waits (without reaping) until the process is a zombie, i.e. dead with its
    # memory gone but its pid still taken.
    def wait_until_zombie(timeout: READY_TIMEOUT)
      wait_for("process #{pid} to become a zombie", timeout: timeout, interval: POLL_INTERVAL) do
        RubySpyTest.process_state(pid) == "Z"
      end
    end

    # Round trip through a stdio target (spec/fixtures/responder.rb).
    def ping(token, timeout: 5)
      raise "#{name} was not started with stdio: true" unless @stdio

      @stdin.puts("ping #{token}")
      @stdin.flush
      raise "no answer within #{timeout} s" unless IO.select([@stdout], nil, nil, timeout)

      line = @stdout.gets or raise "stdout closed"
      line.chomp
    end

    # A JSON file the fixture writes next to its ready file (READY_PATH + suffix), once it
    # appears.
    def result(suffix, timeout: READY_TIMEOUT)
      path = "#{@ready_path}#{suffix}"
      wait_for("#{name} to write its #{suffix} file", timeout: timeout, interval: POLL_INTERVAL) { File.exist?(path) }
      JSON.parse(File.read(path))
    end

    # For the heap fixtures (Park.rest_for_census): waits until a snapshot shows the main
    # thread in its last sleep (Kernel#sleep on sleep_line, called from rest_line: the sleep
    # before it, on the same line, is followed by the capture Ruby's answers come from), takes
    # the census, and sends SIGUSR1 for those answers. Returns the census and the answers.
    def census_and_answers(timeout: 30)
      handle = RubySpy.attach(pid)
      sleep_line, rest_line = info.fetch_values("sleep_line", "rest_line")
      stack = []
      wait_for("#{name} to sleep on line #{sleep_line} from line #{rest_line}",
               timeout: timeout, interval: 0.05, detail: -> { "its stack: #{stack.first(3).map(&:to_s)}" }) do
        (stack = handle.snapshot).first&.label == "Kernel#sleep" &&
          stack[1]&.lineno == sleep_line && stack[2]&.lineno == rest_line
      end
      census = handle.heap
      Process.kill(:USR1, pid)
      [census, result(".answers")]
    end

    # SIGKILL without reaping: the process becomes a zombie until #reap or #stop.
    def kill!
      Process.kill(:KILL, pid)
    rescue Errno::ESRCH
      nil
    end

    def reap
      return @status if @status

      _, @status = Process.wait2(pid)
      @status
    rescue Errno::ECHILD
      @status
    end

    def stop
      if pid && !@status
        kill!
        reap
      end
      [@stdin, @stdout].each { |io| io.close if io && !io.closed? }
      FileUtils.rm_rf(@dir) if @dir
      nil
    end

    def output
      File.exist?(@log_path.to_s) ? File.read(@log_path) : ""
    end

    def inspect
      "#<#{self.class.name} #{script} pid=#{pid}>"
    end

    private

    def load_ready_file
      @document = JSON.parse(File.read(@ready_path))
      fail_startup("reported an error:\n#{@document["error"]}") if @document["error"]
      unless @document["pid"] == pid
        fail_startup("wrote pid #{@document["pid"]} into its ready file, expected #{pid}")
      end
      @ruby_version = @document.fetch("ruby_version")
      @info = @document["info"] || {}
      @frames = @document["frames"]&.map do |f|
        ExpectedFrame.new(label: f.fetch("label"), base_label: f.fetch("base_label"),
                          path: f.fetch("path"), absolute_path: f["absolute_path"],
                          lineno: f.fetch("lineno"))
      end
    end

    # The watcher thread that recorded the ground truth held the GVL until just after the
    # rename; wait until it has exited or blocked (on Ruby < 3.3 a finished thread's native
    # thread lingers for a few seconds in Ruby's thread cache, asleep). For a parked fixture
    # also wait until the main thread is asleep in the kernel.
    def settle(deadline)
      waits = []
      tid = @document["watcher_tid"]
      waits << tid if tid
      waits << pid if @frames && !@document["spinning"] # a spinning fixture never sleeps
      waits.each do |t|
        state = nil
        wait_for("fixture #{script} (pid #{pid}): thread #{t} to settle", timeout: deadline - monotonic,
                 interval: POLL_INTERVAL, detail: -> { "state #{state}\n#{its_output}" }) do
          (state = thread_state(t)).nil? || state == "S"
        end
      end
    end

    def thread_state(tid)
      RubySpyTest.stat_fields("#{pid}/task/#{tid}")&.first
    end

    def reap_nonblocking
      return if @status || pid.nil?

      _, status = Process.wait2(pid, Process::WNOHANG)
      @status = status if status
    rescue Errno::ECHILD
      nil
    end

    def fail_startup(what)
      raise "fixture #{script} (pid #{pid}) #{what}\n#{its_output}"
    end

    def its_output
      "--- its output ---\n#{output}"
    end

    def monotonic
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end
  end
end
