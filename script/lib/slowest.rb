# frozen_string_literal: true

# The N slowest examples over every rspec run of a script/test, from the JSON each run wrote
# (rspec --format json --out tmp/ci/rspec/RUN.json), and the N spec files whose wall time,
# summed over the runs, is longest (RUN.files, spec/support/file_times.rb: what the examples'
# times miss, their files' before(:context) hooks, shows there): where a run's minutes go.
#   ruby script/lib/slowest.rb N FILE...
require "json"

count = Integer(ARGV.shift)
examples = ARGV.flat_map do |file|
  run = File.basename(file, ".json")
  JSON.parse(File.read(file)).fetch("examples", []).map { |e| e.merge("run" => run) }
rescue JSON::ParserError, Errno::ENOENT
  [] # a run killed before it wrote its report
end
examples.max_by(count) { |e| e["run_time"].to_f }.each do |e|
  printf("%7.1fs  %-28s %s:%d %s\n", e["run_time"].to_f, e["run"], e["file_path"].delete_prefix("./"),
         e["line_number"], e["full_description"][0, 90])
end

files = Hash.new { |h, k| h[k] = [0.0, 0] }
ARGV.each do |file|
  JSON.parse(File.read(file.sub(/\.json\z/, ".files"))).each do |path, seconds|
    files[path.delete_prefix("./")][0] += seconds
    files[path.delete_prefix("./")][1] += 1
  end
rescue JSON::ParserError, Errno::ENOENT
  next
end
unless files.empty?
  puts "--- the #{count} spec files with the longest wall time, hooks included, over every run"
  files.max_by(count) { |_, (seconds, _)| seconds }.each do |path, (seconds, runs)|
    printf("%7.1fs  %3d run%s  %s\n", seconds, runs, runs == 1 ? " " : "s", path)
  end
end
