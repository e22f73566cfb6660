# frozen_string_literal: true

# What the Rails integration costs a request: requests per second of a trivial action
# (spec/fixtures/rails_app/overlay, HelloController#show) served by Puma with the Railtie's tags on
# and with config.rubyspy.tags = false, measured in alternating windows against the same
# pair of servers so that drift in the machine's speed hits both alike.
#
#   rake compile && ruby bench/rails.rb [ROUNDS] [SECONDS]
#
# Prints each window and the median of each side; the target is < 2 % slower with tags.
$LOAD_PATH.unshift File.expand_path("../lib", __dir__)
require "net/http"
require "socket"
require "tmpdir"

ROOT = File.expand_path("..", __dir__)
rounds = Integer(ARGV.fetch(0, "8"))
window = Float(ARGV.fetch(1, "2"))

# The app spec/rails_spec.rb serves: `rails new` plus spec/fixtures/rails_app/overlay, with
# rbspy_ext in its Gemfile.
def generate_app(dir)
  app = File.join(dir, "rails_app")
  system(RbConfig.ruby, File.join(ROOT, "spec/fixtures/rails_app/generate"), app, exception: true)
  app
end

def start_puma(dir, app, tags)
  port = TCPServer.open("127.0.0.1", 0) { |s| s.addr[1] }
  env = { "PORT" => port.to_s, "PIDFILE" => File.join(dir, "#{tags}.pid"), "BUNDLE_GEMFILE" => File.join(app, "Gemfile"),
          "RAILS_ENV" => "production", "RUBYSPY_TAGS" => tags ? "1" : "0" }
  pid = Process.spawn(env, "bundle", "exec", "puma", "-C", File.join(ROOT, "spec/fixtures/puma.rb"),
                      File.join(app, "config.ru"), chdir: app, out: File::NULL, err: File::NULL, pgroup: true)
  http = nil
  60.times do
    http = Net::HTTP.start("127.0.0.1", port)
    break if http.get("/tags").code == "200"
  rescue SystemCallError
    sleep 0.5
  end
  abort "puma did not start" unless http
  [pid, http]
end

def rps(http, seconds)
  n = 0
  deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + seconds
  while Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
    raise "bad response" unless http.get("/hello").code == "200"

    n += 1
  end
  n / seconds
end

def median(values)
  s = values.sort
  s[s.size / 2]
end

Dir.mktmpdir do |dir|
  app = generate_app(dir)
  servers = { tags: start_puma(dir, app, true), none: start_puma(dir, app, false) }
  servers.each_value { |_, http| rps(http, 1) } # warm up
  results = Hash.new { |h, k| h[k] = [] }
  rounds.times do |i|
    order = i.even? ? %i[tags none] : %i[none tags]
    order.each { |side| results[side] << rps(servers[side][1], window) }
    printf("round %d: with tags %.0f, without %.0f requests/s\n", i + 1, results[:tags].last, results[:none].last)
  end
  with = median(results[:tags])
  without = median(results[:none])
  printf("median: with tags %.0f, without %.0f requests/s: tags cost %.2f %% (%.1f us a request)\n",
         with, without, (1 - with / without) * 100, (1.0 / with - 1.0 / without) * 1e6)
ensure
  # Waited for before the directory (their pid files) goes.
  servers&.each_value do |pid, _|
    Process.kill(:TERM, -pid)
    Process.wait(pid)
  rescue SystemCallError
    nil
  end
end
