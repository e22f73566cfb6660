# frozen_string_literal: true

require "io/console"

module RubySpy
  module CLI
    # `rubyspy top --pid PID`: a live view of where a process spends its time, like py-spy's
    # top. It records the process (every thread), redraws once a second with the functions
    # by the samples they were innermost in (%Own) and on the stack at all (%Total) since it
    # started, the share of each thread state, and each thread's current tags. Blocked
    # threads' samples are left out unless --idle; waits for the GVL and GC pauses are rows of
    # their own ([waiting for GVL], [GC marking]...) unless --no-state-leaves. Keys: 1-4 sort by a column, q or Ctrl-C
    # quits; it also ends, saying so, when the process exits.
    class Top
      # Sort keys by the key that picks them.
      SORTS = { "1" => :own, "2" => :total, "3" => :function, "4" => :file }.freeze
      SORT_NAMES = { own: "%Own", total: "%Total", function: "Function", file: "File:line" }.freeze
      KEYS_HELP = "Keys: 1 %Own  2 %Total  3 Function  4 File:line  q quit"

      # @param pid [Integer]
      # @param rate [Numeric] samples per second
      # @param idle [Boolean] count blocked threads' samples too
      # @param state_leaves [Boolean] waits for the GVL and GC pauses as rows of their own
      #   (+[waiting for GVL]+, +[GC marking]+...), not as their functions' own time
      # @param force_version [String, nil]
      # @param interval [Numeric] seconds between redraws
      def initialize(pid, rate:, idle:, force_version:, state_leaves: true, input: $stdin, output: $stdout,
                     interval: 1.0)
        @pid, @rate, @idle, @force_version = pid, rate, idle, force_version
        @state_leaves = state_leaves
        @input, @output, @interval = input, output, interval
        @sort = :own
      end

      # Runs until q, Ctrl-C or the process's exit.
      # @return [Integer] the exit status
      # @raise [Usage] without a terminal
      def run
        unless @input.tty? && @output.tty?
          raise Usage, "top needs a terminal (it redraws in place); use rubyspy record for a file"
        end

        recorder = Recorder.new(@pid, rate: @rate, live: true, force_version: @force_version).start
        handle = RubySpy.attach(@pid, force_version: @force_version)
        enter
        begin
          @input.raw { watch(recorder, handle) }
        rescue Interrupt
          nil # a SIGINT from outside the terminal: quit as Ctrl-C does
        end
        leave
        profile = recorder.stop
        recorder = nil
        exited = profile.notes.find { |n| n.start_with?("process #{@pid} ") }
        warn "rubyspy: #{exited}" if exited
        0
      ensure
        leave
        recorder&.stop # on an error: no sampler thread left behind
      end

      private

      # The alternate screen, without a cursor.
      def enter
        @entered = true
        @output.print "\e[?1049h\e[?25l"
      end

      def leave
        return unless @entered

        @entered = false
        @output.print "\e[?25h\e[?1049l"
      end

      def watch(recorder, handle)
        loop do
          draw(recorder, handle)
          return unless recorder.running?

          case read_key
          when "q", "Q", "\u0003", :eof then return
          when *SORTS.keys then @sort = SORTS[@key]
          end
        end
      end

      # The key pressed within the interval (nil if none).
      def read_key
        @key = nil
        return unless IO.select([@input], nil, nil, @interval)

        # The last key typed in the interval wins; a q anywhere quits. Nothing to read from
        # a readable terminal means it hung up: quit rather than spin.
        keys = @input.read_nonblock(16, exception: false)
        return @key = :eof if keys.nil?
        return @key = "q" if keys.is_a?(String) && keys.match?(/[qQ\u0003]/)

        @key = keys.is_a?(String) ? keys[-1] : nil
      end

      def draw(recorder, handle)
        rows, cols = @output.winsize
        profile = recorder.profile_so_far # one copy per redraw, for every part of it
        lines = header(recorder, profile) + tag_lines(handle)
        table = profile ? function_rows(profile, cols) : ["  (collecting samples)"]
        room = [rows - lines.size - 2, 1].max
        lines.concat(table.first(room))
        lines << KEYS_HELP
        @output.print("\e[H\e[2J" + lines.map { |l| fit(l, cols) }.join("\r\n"))
        @output.flush
      end

      def header(recorder, profile)
        progress = recorder.progress
        lines = [format("rubyspy top: pid %<pid>d, %<s>.0f s, %<n>d samples at %<hz>g Hz, sorted by %<by>s",
                        pid: @pid, s: progress[:elapsed], n: progress[:samples], hz: @rate,
                        by: SORT_NAMES.fetch(@sort))]
        lines << states_line(profile) if profile
        lines.concat(ractor_lines(profile)) if profile
        lines
      end

      # Once threads of other Ractors than the main one are seen: each Ractor's threads and
      # how much of their time they ran (at most four lines).
      def ractor_lines(profile)
        ractors = profile.threads.group_by { |t| t[:ractor] }
        return [] unless ractors.keys.any? { |id| id.to_i > 1 }

        ractors.sort_by { |id, _| id.to_i }.first(4).map do |id, threads|
          states = Hash.new(0)
          threads.each { |t| t[:states].each { |s, n| states[s] += n } }
          running = 100.0 * states["running"] / [states.values.sum, 1].max
          name = id.to_i > 1 ? RubySpy.ractor_text(threads.first) : "main ractor"
          format("  %s: %d thread%s, running %.1f%%", name, threads.size, threads.size == 1 ? "" : "s", running)
        end
      end

      # Each state's share of the samples, over every thread.
      def states_line(profile)
        states = Hash.new(0)
        profile.threads.each { |t| t[:states].each { |s, n| states[s] += n } }
        total = [states.values.sum, 1].max
        shares = states.sort_by { |s, n| [-n, s] }.map { |s, n| format("%s %.1f%%", s, 100.0 * n / total) }
        idle = @idle ? "" : "  (blocked threads left out below; --idle counts them)"
        "Threads: #{profile.threads.size}  #{shares.join("  ")}#{idle}"
      end

      # The current tags of each thread that has some (at most three lines).
      def tag_lines(handle)
        tagged = handle.thread_snapshots.reject { |t| t[:tags].empty? }
        tagged.first(3).map do |t|
          name = t[:name] || (t[:main] ? "main" : t[:tid].to_s)
          name += " in #{RubySpy.ractor_text(t)}" if t[:ractor].to_i > 1
          "Tags of #{name}: #{t[:tags].map { |k, v| "#{k}=#{v}" }.join(" ")}"
        end
      rescue RubySpy::Error
        [] # the process is going: the recorder says so
      end

      def function_rows(profile, cols)
        rows = profile.functions(idle: @idle, state_leaves: @state_leaves)
        counted = @idle ? profile.samples : profile.samples - profile.samples_in(:blocked)
        counted = [counted, 1].max
        rows = sort(rows)
        width = [cols - 17, 20].max
        fn_width = (width * 0.55).floor
        file_width = width - fn_width
        head = format(" %6s %7s  %-*s %s", "%Own", "%Total", fn_width, "Function", "File:line")
        [head] + rows.map do |f|
          format(" %6.1f %7.1f  %-*s %s", 100.0 * f[:self] / counted, 100.0 * f[:total] / counted,
                 fn_width, cut(f[:label], fn_width), cut_left(place(f), file_width))
        end
      end

      def sort(rows)
        case @sort
        when :own then rows.sort_by { |f| [-f[:self], -f[:total], f[:label]] }
        when :total then rows.sort_by { |f| [-f[:total], -f[:self], f[:label]] }
        when :function then rows.sort_by { |f| [f[:label], f[:path]] }
        else rows.sort_by { |f| [place(f), f[:label]] }
        end
      end

      def place(function)
        return "(thread state)" if function[:state_leaf]

        function[:path].empty? ? "(C function)" : "#{function[:path]}:#{function[:line]}"
      end

      # +text+ cut to +width+ columns at its end.
      def cut(text, width)
        text.size <= width ? text : "#{text[0, width - 1]}…"
      end

      # +text+ cut to +width+ columns at its start (a path's end is what tells files apart).
      def cut_left(text, width)
        text.size <= width ? text : "…#{text[-(width - 1)..]}"
      end

      def fit(line, cols)
        line.size <= cols ? line : line[0, cols]
      end
    end
  end
end
