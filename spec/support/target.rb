# frozen_string_literal: true

require "fileutils"
require "json"
require "open3"
require "rbconfig"
require "tmpdir"

module RubySpyTest
  ROOT = File.expand_path("../..", __dir__)
  FIXTURES = File.join(ROOT, "spec", "fixtures")

  # The fields of /proc/PATH/stat after the command name ([state, ppid, ...]; PATH "PID" or
  # "PID/task/TID"), nil when it is gone. The name is in parentheses and may itself hold
  # spaces and parentheses.
  def self.stat_fields(path)
    stat = File.read("/proc/#{path}/stat")
    stat[(stat.rindex(")") + 2)..].split
  rescue SystemCallError
    nil
  end

  # Kernel state letter of a process (R, S, D, T, t, Z, ...), nil when there is none.
  def self.process_state(pid)
    stat_fields(pid)&.first
  end

  # What looks wrong with a live process that a read must leave alone: gone, a zombie,
  # stopped, or traced. Empty when it is running normally.
  def self.process_problems(pid)
    fields = File.readlines("/proc/#{pid}/status").to_h { |l| l.chomp.split(":\t", 2) }
    problems = []
    state = fields["State"].to_s
    problems << "process #{pid} is #{state}" if state.start_with?("T", "t", "Z", "X")
    tracer = fields["TracerPid"].to_i
    problems << "process #{pid} is being traced by #{tracer}" unless tracer.zero?
    problems
  rescue SystemCallError
    ["process #{pid} is gone"]
  end

  # Which Ruby runs the fixture targets. RUBYSPY_TARGET_RUBY=NAME:inside|outside[:JIT] picks a
  # Ruby from script/rubies (NAME as in `script/rubies list`): `inside` runs a Debian Ruby in
  # its chroot (container-style: the paths in the target's /proc/PID/maps do not exist for the
  # reader), `outside` runs the same binary on the host through the chroot's loader, or an
  # upstream Ruby as itself. JIT (yjit or zjit) turns that JIT on in every target (--yjit,
  # --zjit); mn=N starts every target with RUBY_MN_THREADS=N (M:N threads, 3.3+), unless a
  # spec sets its own. Unset: the Ruby running the specs.
  class TargetRuby
    JITS = %w[yjit zjit].freeze

    attr_reader :name, :mode, :root, :jit, :mn

    def self.current
      @current ||= new(ENV["RUBYSPY_TARGET_RUBY"])
    end

    def initialize(spec)
      @name, @mode, *extras = spec.to_s.split(":") if spec && !spec.empty?
      return unless @name

      extras.each do |extra|
        if JITS.include?(extra) && @jit.nil?
          @jit = extra
        elsif extra.match?(/\Amn=-?\d+\z/) && @mn.nil?
          @mn = extra.delete_prefix("mn=")
        else
          @mode = nil # reported below
        end
      end
      unless %w[inside outside].include?(@mode)
        raise ArgumentError, "RUBYSPY_TARGET_RUBY=#{spec}: expected NAME:inside or NAME:outside, " \
                             "optionally followed by :#{JITS.join(' or :')} and :mn=N"
      end

      line = IO.popen([File.join(ROOT, "script", "rubies"), "list"], &:read).lines
               .map(&:split).find { |fields| fields[0] == @name }
      raise ArgumentError, "#{@name} is not built (script/rubies build #{@name})" unless line

      @root = line[2]
      @version = line[1]
      upstream = line[4] == "upstream"
      raise ArgumentError, "#{@name} is an upstream build with no chroot: use #{@name}:outside" if upstream && inside?

      sync_fixtures if inside?
    end

    # The target Ruby's version, as a Gem::Version.
    def version
      Gem::Version.new(host? ? RUBY_VERSION : @version)
    end

    # Whether fixtures can load rbspy_ext into this Ruby: the host's (rake compile), or a
    # chroot's with its own build in lib/rbspy_ext/X.Y/ (script/rubies ext NAME).
    def extension?
      host? || File.exist?(File.join(ROOT, "lib", "rbspy_ext", version.segments.first(2).join("."), "rbspy_ext.so"))
    end

    def host?
      @name.nil?
    end

    def inside?
      @mode == "inside"
    end

    def to_s
      return "host Ruby #{RUBY_VERSION}" if host?

      "#{@name} (#{[@mode, @jit, @mn && "RUBY_MN_THREADS=#{@mn}"].compact.join(', ')})"
    end

    # What every target of this Ruby is started with (RUBY_MN_THREADS for :mn=N).
    def env
      @mn ? { "RUBY_MN_THREADS" => @mn } : {}
    end

    # The command that runs `args` from the repository root.
    def command(*args)
      return [RbConfig.ruby, *args] if host?

      flags = @jit ? ["--#{@jit}"] : []
      proc = @proc && inside? ? ["--proc"] : []
      [File.join(ROOT, "script", "rubies"), "run", @name, @mode, "--chdir", ROOT, *proc, "--", *flags, *args]
    end

    # The same Ruby, with /proc mounted in its chroot when it runs inside one (script/rubies
    # run --proc), for a fixture that reads its own memory through /proc, as one serving its
    # own profiles does. A container always has /proc; a bare chroot does not.
    def with_proc
      dup.tap { |ruby| ruby.instance_variable_set(:@proc, true) }
    end

    # Where a path the target uses lives for the specs (inside a chroot: under its root).
    def host_path(path)
      inside? ? File.join(@root, path) : path
    end

    # A fresh directory both sides can use; returns [path for the target, path for specs].
    def mktmpdir(prefix)
      return [Dir.mktmpdir(prefix)] * 2 unless inside?

      host = Dir.mktmpdir(prefix, File.join(@root, "tmp"))
      [host.delete_prefix(@root), host]
    end

    private

    # The chroot sees the fixtures (and lib/, for the fixtures that load rbspy_ext) at the
    # same absolute path as the host, so relative and absolute paths in its backtraces look
    # as they would on a host.
    def sync_fixtures
      %w[spec lib].each do |dir|
        target = File.join(@root, ROOT, dir)
        FileUtils.rm_rf(target)
        FileUtils.mkdir_p(File.dirname(target))
        FileUtils.cp_r(File.join(ROOT, dir), target)
      end
    end
  end

  # One frame of the ground truth a fixture recorded from Ruby's own backtrace_locations.
  ExpectedFrame = Struct.new(:label, :base_label, :path, :absolute_path, :lineno,
                             keyword_init: true) do
    def to_s
      "#{path}:#{lineno}:in '#{label}'"
    end
  end

  # A fixture script running in its own process:
  #
  #   RbConfig.ruby spec/fixtures/NAME.rb READY_PATH [ARGS...]
  #
  # run from the repository root (so the main script's path is relative, like in real use)
  # with its output in a private temporary directory. #start returns once the fixture has
  # written its ready file (see spec/fixtures/lib/park.rb) and is settled in the state the
  # file describes.
  class Target
    READY_TIMEOUT = 15 # seconds
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
      @pid = Process.spawn(@env, *ruby.command(script, target_ready_path, *args), options)
      self
    ensure
      child_in&.close
      child_out&.close
    end

    def wait_until_ready
      deadline = monotonic + READY_TIMEOUT
      until File.exist?(@ready_path)
        reap_nonblocking
        fail_startup("exited (#{@status.inspect}) before writing its ready file") if @status
        fail_startup("wrote no ready file within #{READY_TIMEOUT} s") if monotonic > deadline
        sleep POLL_INTERVAL
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
      deadline = monotonic + timeout
      until RubySpyTest.process_state(pid) == "Z"
        raise "process #{pid} did not become a zombie within #{timeout} s" if monotonic > deadline

        sleep POLL_INTERVAL
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
      deadline = monotonic + timeout
      until File.exist?(path)
        raise "#{name} wrote no #{suffix} file within #{timeout} s" if monotonic > deadline

        sleep POLL_INTERVAL
      end
      JSON.parse(File.read(path))
    end

    # For the heap fixtures (Park.rest_for_census): waits until a snapshot shows the main
    # thread in its last sleep (Kernel#sleep on sleep_line, called from rest_line: the sleep
    # before it, on the same line, is followed by the capture Ruby's answers come from), takes
    # the census, and sends SIGUSR1 for those answers. Returns the census and the answers.
    def census_and_answers(timeout: 30)
      handle = RubySpy.attach(pid)
      sleep_line, rest_line = info.fetch_values("sleep_line", "rest_line")
      deadline = monotonic + timeout
      until (stack = handle.snapshot).first&.label == "Kernel#sleep" &&
            stack[1]&.lineno == sleep_line && stack[2]&.lineno == rest_line
        if monotonic > deadline
          raise "#{name} never slept on line #{sleep_line} from line #{rest_line}: #{stack.first(3).map(&:to_s)}"
        end

        sleep 0.05
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
        until (state = thread_state(t)).nil? || state == "S"
          fail_startup("thread #{t} did not settle (state #{state})") if monotonic > deadline
          sleep POLL_INTERVAL
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
      raise "fixture #{script} (pid #{pid}) #{what}\n--- its output ---\n#{output}"
    end

    def monotonic
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end
  end

  # Included into every example group (see spec_helper.rb). Targets started through these
  # helpers are killed and reaped after each example, pass or fail.
  module TargetHelpers
    # Calls the block until it returns something truthy, and returns that; raises naming
    # +what+ after +timeout+ seconds. For waiting until a process is in a state, rather than
    # sleeping for a time that a busy machine may not be able to keep to.
    def wait_for(what, timeout: 10, interval: 0.01)
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout
      loop do
        value = yield
        return value if value
        raise "#{what}: not within #{timeout} s" if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline

        sleep interval
      end
    end

    # Open3.popen3 (+kind+ :popen2 or :popen2e for those), except that a child still running
    # when the block ends is killed first. Open3 closes the pipes and then waits for the
    # child: after an expectation failed in the block, before the child was told to stop, a
    # `rubyspy record` that runs until SIGINT would be waited for forever.
    def popen_killed_after(*cmd, kind: :popen3, **opts)
      Open3.public_send(kind, *cmd, **opts) do |*ios|
        yield(*ios)
      ensure
        begin
          Process.kill(:KILL, ios.last.pid) if ios.last.alive?
        rescue Errno::ESRCH
          nil # exited meanwhile
        end
      end
    end

    # The exit status of the child +wait+ (Open3's waiter thread) once it exits; after
    # +timeout+ seconds, what it is waiting on, then it is killed and the example fails.
    def exit_status(wait, what, timeout: 60)
      return wait.value if wait.join(timeout)

      state = RubySpyTest::HangGuard.describe_process(wait.pid)
      begin
        Process.kill(:KILL, wait.pid)
      rescue Errno::ESRCH
        nil # it exited just now
      end
      raise "#{what}: did not exit within #{timeout} s\n#{state.join("\n")}"
    end

    # Whether process +pid+ is recording: a recorder's sampler thread ("rbspy_ext sampler",
    # which comm cuts to 15 bytes) runs in it.
    def sampler_thread?(pid)
      Dir.glob("/proc/#{pid}/task/*/comm").any? do |path|
        File.read(path).chomp == "rbspy_ext sampl"
      rescue SystemCallError
        false
      end
    end

    def start_target(name, *args, stdio: false, env: {}, ruby: TargetRuby.current)
      target = Target.start(name, *args, stdio: stdio, env: env, ruby: ruby)
      running_targets << target
      target
    end

    # Several copies of the same fixture at once, each with its own ready file; spawned
    # together, then waited for.
    def start_targets(name, count, *args)
      targets = Array.new(count) { Target.new(name, *args) }
      targets.each do |t|
        running_targets << t
        t.spawn
      end
      targets.each(&:wait_until_ready)
      targets
    end

    # Runs the same fixture +times+ times one after another, yielding each running copy and
    # stopping it before the next starts.
    def each_run(name, *args, times:)
      times.times do |i|
        target = start_target(name, *args)
        begin
          yield target, i
        ensure
          target.stop
          running_targets.delete(target)
        end
      end
    end

    def with_target(name, *args, stdio: false)
      target = Target.start(name, *args, stdio: stdio)
      yield target
    ensure
      target&.stop
    end

    def stop_all_targets
      running_targets.each(&:stop)
      running_targets.clear
    end

    def running_targets
      @running_targets ||= []
    end

    # The line of the fixture carrying "# MARKER" (fixtures mark line ranges this way).
    def fixture_line(name, marker)
      path = File.join(FIXTURES, "#{name}.rb")
      index = File.readlines(path).index { |line| line.include?("# #{marker}") }
      raise "no '# #{marker}' in #{path}" unless index

      index + 1
    end
  end
end
