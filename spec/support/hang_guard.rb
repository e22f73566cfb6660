# frozen_string_literal: true

require_relative "proc_stat"

module RubySpyTest
  # Ends an example that runs far longer than any example should, and says where it stood.
  #
  # Why: a spec that waits on something that never comes (a child that ignores a signal, a
  # read from a pipe nobody writes) otherwise waits until CI's own limit kills the whole
  # run, and the log then shows only the dots before it. This is a guard against hangs,
  # not a time limit on what is tested: the bound (RUBYSPY_EXAMPLE_TIMEOUT, 600 s) is many
  # times the slowest example's time on a busy machine.
  #
  # When an example passes the bound, the guard prints the Ruby threads of the rspec process
  # and every process under it (command line, state and each thread's kernel wait), kills
  # those processes (so a wait on one of them returns) and raises HungExample in the example.
  # An example that still has not ended a minute later is stuck in native code: the run
  # exits, since nothing after it could be trusted.
  class HungExample < StandardError; end

  module HangGuard
    module_function

    LIMIT = Float(ENV.fetch("RUBYSPY_EXAMPLE_TIMEOUT", "600"))
    GRACE = 60 # seconds an interrupted example has to end
    CHECK_EVERY = [LIMIT / 10, 5].min

    # One thread, started before the first example, watches every example, so that examples
    # which count threads or trace allocations in the spec's own process see no thread start
    # or end around them: it wakes every few seconds, and allocates nothing until an example
    # overruns.
    def start
      @watcher ||= Thread.new { watch }
    end

    def around(example)
      @runner = Thread.current
      @started = monotonic
      @example = example
      example.run
    ensure
      @example = nil
    end

    def watch
      Thread.current.report_on_exception = false
      Thread.current.name = "hang guard"
      loop do
        sleep CHECK_EVERY
        example = @example
        next unless example && monotonic - @started > LIMIT

        interrupt(example, @runner)
        sleep GRACE
        next unless @example.equal?(example)

        $stderr.puts "HUNG #{example.location}: did not end #{GRACE} s after the interrupt; ending the run"
        $stderr.flush
        exit!(1)
      end
    end

    def monotonic
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end

    def interrupt(example, runner)
      report = ["HUNG #{example.location} #{example.full_description}: still running after #{LIMIT.round} s"]
      report.concat(ruby_threads)
      pids = descendants(Process.pid)
      report.concat(pids.flat_map { |pid| describe_process(pid) })
      $stderr.puts report
      $stderr.flush
      pids.each do |pid|
        Process.kill(:KILL, pid)
      rescue SystemCallError
        nil # gone meanwhile
      end
      runner.raise(HungExample, "still running after #{LIMIT.round} s (what each thread and process " \
                                "was waiting on is printed above, under HUNG)")
    end

    def ruby_threads
      Thread.list.reject { |t| t == Thread.current }.flat_map do |t|
        ["  Ruby thread #{t.name || t.object_id} (#{t.status}):", *(t.backtrace || []).grep_v(%r{/rspec-core-}).first(30).map { |l| "      #{l}" }]
      end
    end

    # Every process whose chain of parents leads to +root+, parents first.
    def descendants(root)
      children = Hash.new { |h, k| h[k] = [] }
      Dir.glob("/proc/[0-9]*").each do |dir|
        pid = File.basename(dir).to_i
        ppid = RubySpyTest.stat_fields(pid)&.fetch(1) or next # exited meanwhile
        children[ppid.to_i] << pid
      end
      found = []
      queue = children[root].dup
      until queue.empty?
        pid = queue.shift
        found << pid
        queue.concat(children[pid])
      end
      found
    end

    def describe_process(pid)
      cmdline = File.read("/proc/#{pid}/cmdline").split("\0").join(" ")
      state = RubySpyTest.process_state(pid)
      lines = ["  process #{pid} (#{state}): #{cmdline[0, 300]}"]
      Dir.glob("/proc/#{pid}/task/*").each do |task|
        kernel = read_or("#{task}/stack", "").lines.first(6).map { |l| l.split(" ", 2).last.strip }
        lines << "      thread #{File.basename(task)} #{read_or("#{task}/comm", "?").strip}: " \
                 "waits in #{read_or("#{task}/wchan", "?")} #{kernel.join(' < ')}"
      end
      lines
    rescue SystemCallError
      ["  process #{pid}: exited"]
    end

    # A task's file, or +fallback+ when it went away or may not be read (stack needs root).
    def read_or(path, fallback)
      File.read(path)
    rescue SystemCallError
      fallback
    end
  end
end

RSpec.configure do |config|
  config.before(:suite) { RubySpyTest::HangGuard.start }
  config.around { |example| RubySpyTest::HangGuard.around(example) }
end
