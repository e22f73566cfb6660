# frozen_string_literal: true

require "cgi"
require "json"

module RubySpyTest
  # Each format's self samples, read back from what the writer wrote: name (as the format
  # prints a frame) => samples in which it was the innermost frame. Used to check that every
  # view bills a frame the samples it ran in and nothing else (spec/state_leaves_spec.rb).
  module ViewSelf
    module_function

    # The summary's (or lines') table whose title starts with +title+: name => samples.
    def summary_table(text, title)
      rows = text.lines.drop_while { |l| !l.start_with?(title) }.drop(2).take_while { |l| l.strip != "" }
      rows.each_with_object(Hash.new(0)) do |row, self_samples|
        m = /\A\s*[\d.]+\s+(\d+)\s+(.+)\n?\z/.match(row) or raise ArgumentError, "not a summary row: #{row.inspect}"
        self_samples[m[2]] += Integer(m[1])
      end
    end

    # Folded stacks: the innermost frame of each line => its count.
    def collapsed(text)
      RubySpyTest::Recording.parse_collapsed(text).each_with_object(Hash.new(0)) do |(stack, count), out|
        out[stack.split(";").last] += count
      end
    end

    # An inferno flame graph: each frame's width (fg:w, in samples) less its children's,
    # summed by name. A child sits one row up (16 px) inside its parent's samples (fg:x).
    def flamegraph(svg)
      nodes = svg.scan(%r{<g><title>(.*?) \(([\d,]+) samples?, [^)]*\)</title><rect [^>]*?y="(\d+)"[^>]*?fg:x="(\d+)" fg:w="(\d+)"})
                 .map { |name, _, y, x, w| { name: CGI.unescapeHTML(name), y: Integer(y), x: Integer(x), w: Integer(w) } }
      raise ArgumentError, "no frames in the flame graph" if nodes.empty?

      rows = nodes.group_by { |n| n[:y] }
      nodes.reject { |n| n[:name] == "all" }.each_with_object(Hash.new(0)) do |node, out|
        children = rows.fetch(node[:y] - 16, []).select { |c| c[:x] >= node[:x] && c[:x] < node[:x] + node[:w] }
        out[node[:name]] += node[:w] - children.sum { |c| c[:w] }
      end
    end

    # speedscope "sampled" profiles: the innermost frame's name of each sample => its weight
    # in samples (weights are milliseconds: +ms_per_sample+ each).
    def speedscope(json, ms_per_sample)
      doc = JSON.parse(json)
      names = doc["shared"]["frames"].map { |f| f["name"] }
      doc["profiles"].each_with_object(Hash.new(0)) do |profile, out|
        profile["samples"].zip(profile["weights"]).each do |stack, weight|
          out[names[stack.last]] += (weight / ms_per_sample).round unless stack.empty?
        end
      end
    end

    # `go tool pprof -top -sample_index=samples` output: the flat column by name.
    def pprof_top(text)
      text.lines.drop_while { |l| !l.match?(/^\s+flat\s+flat%/) }.drop(1).each_with_object(Hash.new(0)) do |line, out|
        m = /\A\s*(\d+)\s+[\d.]+%\s+[\d.]+%\s+\d+\s+[\d.]+%\s+(.+)\n?\z/.match(line) or
          raise ArgumentError, "not a pprof -top row: #{line.inspect}"
        out[m[2]] += Integer(m[1])
      end
    end

    # callgrind.out: each function's self cost (the cost lines not following a calls= line).
    # Names are compressed: "(3) name" the first time, "(3)" after.
    def callgrind(text)
      names = {}
      current = nil
      after_call = false
      text.each_line.with_object(Hash.new(0)) do |line, out|
        case line
        when /\Afn=\((\d+)\)(?: (.*))?\n?\z/
          names[$1] = $2 if $2
          current = names.fetch($1)
        when /\Acfn=\((\d+)\)(?: (.*))?\n?\z/
          names[$1] = $2 if $2
        when /\Acalls=/
          after_call = true
        when /\A\d+ (\d+)\n?\z/
          out[current] += Integer($1) unless after_call
          after_call = false
        end
      end
    end
  end
end
