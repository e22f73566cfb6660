# frozen_string_literal: true

require "json"
require "optparse"
require_relative "../rbspy_ext"

# The `rubyspy` command (exe/rubyspy is only its entry point), here so that specs and other
# programs can run it in-process: `RubySpy::CLI.run(%w[snapshot --pid 42])` returns the exit
# status and writes to $stdout and $stderr.
module RubySpy
  # The command-line interface; see `rubyspy --help`.
  module CLI
    # A problem with the command line itself: one line and exit 2.
    class Usage < StandardError; end

    module_function

    # Runs one `rubyspy` command line.
    # @param argv [Array<String>] the arguments after `rubyspy` (consumed)
    # @return [Integer] the exit status: 0, 1 for an error reading or writing, 2 for a usage
    #   error (each printed to $stderr as one line)
    def run(argv)
      verbose = argv.delete("--verbose")
      command = argv.shift
      # Without native code every command fails the same way: say why before parsing options
      # (the formats, for one, come from the extension).
      if %w[snapshot record report tags].include?(command) && RubySpy::Native.unsupported_reason
        raise RubySpy::UnsupportedPlatform, RubySpy::Native.unsupported_message
      end
      case command
      when "snapshot" then snapshot(argv)
      when "record" then record(argv)
      when "report" then report(argv)
      when "tags" then tags(argv)
      when nil, "-h", "--help", "help" then puts(top_help) || 0
      when "-V", "--version", "version" then puts("rubyspy #{RubySpy::VERSION}") || 0
      else raise Usage, "unknown command #{command.inspect} (snapshot, record, report, tags)"
      end
    rescue Usage, OptionParser::ParseError => e
      warn "rubyspy: #{e.message}"
      2
    rescue RubySpy::Error, ArgumentError, TypeError, SystemCallError => e
      warn "rubyspy: #{e.message}"
      warn e.backtrace.join("\n") if verbose
      1
    end

    def top_help
      <<~HELP
        Usage: rubyspy COMMAND [options]   (rubyspy COMMAND --help for each)
          snapshot   print what a Ruby process is doing right now
          record     sample a process (or a command) and write a profile
          report     render a raw profile in another format
          tags       print each thread's tags (RubySpy.tag) and where BPF programs find them
        Common: --verbose shows backtraces of errors; rubyspy --version prints the version.
      HELP
    end

    def pid_option(opts, options)
      opts.on("-p", "--pid PID", Integer, "the process to read") do |v|
        raise Usage, "--pid must be a positive process id, got #{v}" unless v.positive?

        options[:pid] = v
      end
      opts.on("--force-version VERSION", "read the process with this Ruby release's layout (e.g. 3.3.8), " \
                                         "for a build whose version string misleads") do |v|
        options[:force_version] = v
      end
    end

    def snapshot(argv)
      options = { threads: "gvl" }
      parser = OptionParser.new do |opts|
        opts.banner = "Usage: rubyspy snapshot --pid PID [--threads all]"
        pid_option(opts, options)
        opts.on("--threads WHICH", %w[all gvl], "all threads, or the GVL holder (default)") do |v|
          options[:threads] = v
        end
        opts.on("--json", "print JSON: the frames and tags, or with --threads all every thread") do
          options[:json] = true
        end
        opts.on("-h", "--help") { puts opts; return 0 }
      end
      parser.parse!(argv)
      raise Usage, "snapshot needs --pid PID" unless options[:pid]

      handle = RubySpy.attach(options[:pid], force_version: options[:force_version])
      return snapshot_json(handle, options[:threads] == "all") if options[:json]

      if options[:threads] == "all"
        handle.thread_snapshots.each do |t|
          puts "Thread #{t[:tid]}#{" (#{t[:name]})" if t[:name]}#{" main" if t[:main]}: #{t[:state]}"
          puts "  tags: #{tag_text(t[:tags])}" unless t[:tags].empty?
          t[:frames].each { |f| puts "  #{f}" }
        end
      else
        stack = handle.snapshot
        puts "tags: #{tag_text(stack.tags)}" unless stack.tags.empty?
        puts stack
      end
      0
    end

    # `snapshot --json`: {pid, ruby_version, frames, tags}, or {pid, ruby_version, threads}
    # with each thread's tid, name, main, state, tags and frames. Frames are Frame#to_h.
    def snapshot_json(handle, all)
      doc = { pid: handle.pid, ruby_version: handle.ruby_version }
      if all
        doc[:threads] = handle.thread_snapshots.map { |t| t.merge(frames: t[:frames].map(&:to_h)) }
      else
        stack = handle.snapshot
        doc[:tags] = stack.tags
        doc[:frames] = stack.map(&:to_h)
      end
      puts JSON.generate(doc)
      0
    end

    def tag_text(tags)
      tags.map { |k, v| "#{k}=#{v}" }.join(" ")
    end

    def tags(argv)
      options = {}
      parser = OptionParser.new do |opts|
        opts.banner = "Usage: rubyspy tags --pid PID"
        pid_option(opts, options)
        opts.on("-h", "--help") { puts opts; return 0 }
      end
      parser.parse!(argv)
      raise Usage, "tags needs --pid PID" unless options[:pid]

      handle = RubySpy.attach(options[:pid], force_version: options[:force_version])
      offset = handle.profiler_state_offset
      unless offset
        puts "process #{options[:pid]} has not loaded rbspy_ext: no ruby_profiler_state to read"
        return 0
      end
      puts "ruby_profiler_state_tp_offset: #{offset} (see docs/profiler-state.md)"
      handle.thread_snapshots.each do |t|
        name = "Thread #{t[:tid]}#{" (#{t[:name]})" if t[:name]}#{" main" if t[:main]}"
        puts "#{name}: #{t[:tags].empty? ? "(no tags)" : tag_text(t[:tags])}"
      end
      0
    end

    def record(argv)
      command = (i = argv.index("--")) ? argv.slice!(i..)[1..] : nil
      options = { rate: 99, format: "flamegraph", threads: :all, on_cpu: false }
      parser = OptionParser.new do |opts|
        opts.banner = "Usage: rubyspy record (--pid PID | -- COMMAND ARGS...) [options]"
        pid_option(opts, options)
        opts.on("-r", "--rate HZ", Float, "samples per second (default 99)") { |v| options[:rate] = v }
        opts.on("-d", "--duration SECONDS", Float, "stop after this long") { |v| options[:duration] = v }
        opts.on("-f", "--format NAME", Profile::FORMATS.map(&:to_s),
                "#{Profile::FORMATS.join(", ")} (default flamegraph)") { |v| options[:format] = v }
        opts.on("-o", "--output PATH", "where to write (default rubyspy-PID-TIME.EXT)") { |v| options[:output] = v }
        opts.on("--threads WHICH", %w[all gvl], "all threads (default) or the GVL holder") do |v|
          options[:threads] = v.to_sym
        end
        opts.on("--on-cpu", "keep only samples of threads holding the GVL") { options[:on_cpu] = true }
        opts.on("--by-tag KEY", "flamegraph/collapsed: a root per value of this tag; speedscope: a profile per value") do |v|
          options[:tag] = v
        end
        opts.on("--subprocesses", "also record Ruby child processes") { options[:subprocesses] = true }
        opts.on("-h", "--help") { puts opts; return 0 }
      end
      parser.parse!(argv)
      raise Usage, "unexpected arguments: #{argv.join(" ")}" unless argv.empty?
      raise Usage, "record needs --pid PID or -- COMMAND" unless options[:pid] || command
      raise Usage, "give either --pid or a command, not both" if options[:pid] && command

      # Everything that can be checked is checked before a command is started.
      check_writable(options[:output]) if options[:output]
      record_options = { rate: options[:rate], duration: options[:duration],
                         threads: options[:threads], on_cpu: options[:on_cpu],
                         subprocesses: options[:subprocesses] ? true : false,
                         force_version: options[:force_version] }
      begin
        RecordOptions.new(**record_options)
      rescue ArgumentError, TypeError => e
        raise Usage, e.message
      end
      pid = options[:pid] || spawn_ruby(command, options[:force_version])
      output = options[:output] || "rubyspy-#{pid}-#{Time.now.strftime("%Y%m%d-%H%M%S")}.#{Profile::EXTENSIONS[options[:format].to_sym]}"
      check_writable(output)
      recorder = Recorder.new(pid, **record_options).start
      interrupted = false
      trap("INT") { interrupted = true }
      show = $stderr.tty?
      shown = 0
      until interrupted || !recorder.running?
        sleep 0.25
        shown = live_display(pid, recorder.progress, shown) if show
      end
      profile = recorder.stop
      profile.write(output, format: options[:format], tag: options[:tag])
      profile.notes.each { |n| warn "rubyspy: #{n}" }
      warn "rubyspy: wrote #{profile.samples} samples to #{output}"
      0
    ensure
      if command && pid
        begin
          Process.kill(:TERM, pid) if interrupted
          Process.wait(pid)
        rescue SystemCallError
          nil
        end
      end
    end

    # Redraws the terminal status: elapsed time, samples and the live top 10 (functions most
    # often on top of a stack). Returns the number of lines drawn.
    def live_display(pid, progress, previous_lines)
      lines = [format("recording pid %d: %.1f s, %d samples (Ctrl-C stops and writes)",
                      pid, progress[:elapsed], progress[:samples])]
      total = [progress[:samples], 1].max
      progress[:top].each do |label, n|
        lines << format("  %5.1f%%  %s", 100.0 * n / total, label)
      end
      $stderr.print("\e[#{previous_lines}A") if previous_lines.positive?
      $stderr.print(lines.map { |l| "\e[2K#{l}\n" }.join)
      lines.size
    end

    # Starts a command and waits (up to 10 s) until its Ruby VM can be read: while it execs
    # (a wrapper script) or Ruby boots, attaching fails in passing ways.
    def spawn_ruby(command, force_version)
      pid = Process.spawn(*command)
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 10
      begin
        RubySpy.attach(pid, force_version: force_version)
      rescue RubySpy::NotRubyProcess, RubySpy::NoSuchProcess, RubySpy::CorruptMemory,
             RubySpy::StackChanged
        raise if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline || Process.wait(pid, Process::WNOHANG)

        sleep 0.01
        retry
      end
      pid
    end

    def check_writable(path)
      return if File.exist?(path) && !File.directory?(path) && File.writable?(path) # /dev/null, or a file to replace

      dir = File.dirname(File.expand_path(path))
      raise Usage, "cannot write #{path}: #{dir} is not a writable directory" unless File.directory?(dir) && File.writable?(dir)
    end

    def report(argv)
      options = { format: "summary" }
      parser = OptionParser.new do |opts|
        opts.banner = "Usage: rubyspy report --input RAW [--format NAME] [--output PATH]"
        opts.on("--input PATH", "a profile written with --format raw") { |v| options[:input] = v }
        opts.on("-f", "--format NAME", Profile::FORMATS.map(&:to_s), "default summary") { |v| options[:format] = v }
        opts.on("-o", "--output PATH", "default: standard output") { |v| options[:output] = v }
        opts.on("-h", "--help") { puts opts; return 0 }
      end
      parser.parse!(argv)
      raise Usage, "report needs --input RAW" unless options[:input]

      profile = Profile.load(options[:input])
      if options[:output]
        check_writable(options[:output])
        profile.write(options[:output], format: options[:format])
      else
        $stdout.binmode.write(profile.render(options[:format]))
      end
      0
    end
  end
end
