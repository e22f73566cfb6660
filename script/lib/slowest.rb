# frozen_string_literal: true

# The N slowest examples over every rspec run of a script/test, from the JSON each run wrote
# (rspec --format json --out tmp/ci/rspec/RUN.json): where a run's minutes go, across Rubies.
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
