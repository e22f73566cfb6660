# frozen_string_literal: true

# What sampled allocation tracking costs a Rails request (issue 38): CatalogController#index
# of spec/fixtures/rails_app (a JSON catalog of 300 items built and rendered on each request),
# called through the whole Rails middleware stack in one process, in windows of REQUESTS
# requests: without any tool, with RubySpy.track_allocations as it is by default (512 KiB,
# at most 100 samples a second: "rubyspy:default"), at 512 KiB with no cap and at 32 KiB,
# and, where Debian has them for this Ruby, stackprof's object mode (every
# allocation, and interval 1000) and memory_profiler. The windows of one round run in a
# shuffled order; each figure is the median over rounds of the process's CPU time per request
# (CLOCK_PROCESS_CPUTIME_ID: the tracker's signal handler and jobs included), which a shared machine's other work
# reaches less than wall time.
#
#   rake compile && ruby bench/allocs_rails.rb [ROUNDS] [REQUESTS]        # Rails 6.1, Ruby 3.1
#   script/rubies ext trixie && ruby bench/allocs_rails.rb --in trixie [ROUNDS] [REQUESTS]
#                                                                        # Rails 7.2, Ruby 3.3
# Defaults: 15 rounds of 300 requests. TOOLS=none,rubyspy:default,rubyspy:4096 picks the
# windows. The untracked windows and ours first serve WARMUP seconds' worth of requests
# (default 1), untimed: what tracking costs when left on, not in its first second.
require "fileutils"
require "open3"
require "rbconfig"
require "tmpdir"

ROOT = File.expand_path("..", __dir__)
MEMORY_PROFILER = "/usr/share/rubygems-integration/all/gems/memory_profiler-0.9.14/lib"
STACKPROF = "/usr/lib/x86_64-linux-gnu/rubygems-integration/#{RbConfig::CONFIG['ruby_version']}"

if ARGV.first == "--in"
  # Runs this script inside a chroot's Ruby (and Rails), over a copy of the checkout's lib,
  # spec and bench at the same path in the chroot.
  name = ARGV[1]
  root = `#{ROOT}/script/rubies list`.lines.map(&:split).find { |f| f[0] == name }&.fetch(2)
  abort "no chroot named #{name}: script/rubies build #{name}" unless root
  %w[lib spec bench].each do |dir|
    target = File.join(root, ROOT, dir)
    FileUtils.rm_rf(target)
    FileUtils.mkdir_p(File.dirname(target))
    FileUtils.cp_r(File.join(ROOT, dir), target)
  end
  # --proc: the tracker finds the words its timer reads the allocation count from through
  # /proc/self (tracker/mod.rs, `read_counters`); without it the job runs at every tick, as
  # in no container that mounts /proc (85 jobs a second on this loop instead of some 25).
  exec(File.join(ROOT, "script", "rubies"), "run", name, "inside", "--chdir", ROOT, "--proc", "--",
       File.join(ROOT, "bench", "allocs_rails.rb"), *ARGV[2..])
end

rounds = Integer(ARGV.fetch(0, "15"))
requests = Integer(ARGV.fetch(1, "300"))

# The request loop, run in the app's own process (Bundler set up from its Gemfile).
LOOP = <<~'RUBY'
  require File.expand_path("config/environment", Dir.pwd)
  require "rack/mock"
  require ENV.fetch("BENCH_SUPPORT")
  rounds, requests = ENV.fetch("ROUNDS").to_i, ENV.fetch("REQUESTS").to_i
  tools = ENV["TOOLS"] ? ENV["TOOLS"].split(",") : %w[none rubyspy:default rubyspy:524288 rubyspy:32768]
  if File.directory?(ENV.fetch("STACKPROF_DIR"))
    stackprof = Dir[File.join(ENV.fetch("STACKPROF_DIR"), "gems", "stackprof-*", "lib")].first
    ext = Dir[File.join(ENV.fetch("STACKPROF_DIR"), "extensions", "*", "*", "stackprof-*")].first
    if stackprof && ext && !ENV["TOOLS"]
      $LOAD_PATH.unshift(stackprof, ext)
      require "stackprof"
      tools += %w[stackprof:1 stackprof:1000]
    end
  end
  if File.directory?(ENV.fetch("MEMORY_PROFILER")) && !ENV["TOOLS"]
    $LOAD_PATH.unshift(ENV.fetch("MEMORY_PROFILER"))
    require "memory_profiler"
    tools << "memory_profiler"
  end
  app = Rails.application
  env = -> { Rack::MockRequest.env_for("https://127.0.0.1/catalog", "HTTP_X_FORWARDED_PROTO" => "https") }
  serve = lambda do |n|
    n.times do
      status, _, body = app.call(env.())
      body.close if body.respond_to?(:close)
      raise "status #{status}" unless status == 200
    end
  end
  cpu = -> { Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID) }
  timed = lambda do |n|
    started = cpu.()
    serve.(n)
    cpu.() - started
  end
  serve.(200) # warm: caches, JIT-free Ruby's inline caches, the JSON encoder
  objects = GC.stat(:total_allocated_objects)
  serve.(50)
  per_request = (GC.stat(:total_allocated_objects) - objects) / 50
  # Tracking is measured as it runs when left on (bench/alloc_cost.rb says why): each window
  # of ours and the untracked ones first serve WARMUP seconds' worth of requests, untimed.
  warm = (Float(ENV.fetch("WARMUP")) / (timed.(50) / 50)).ceil
  times = Hash.new { |h, k| h[k] = [] }
  samples = Hash.new(0)
  missed = Hash.new(0)
  stats = Hash.new { |h, k| h[k] = [] }
  rounds.times do
    tools.shuffle.each do |tool|
      GC.start
      case tool
      when "none"
        serve.(warm)
        times[tool] << timed.(requests)
      when /\Arubyspy:(\d+|default)\z/
        $1 == "default" ? RubySpy.track_allocations : RubySpy.track_allocations(rate: Integer($1))
        serve.(warm)
        warmed = RubySpy::NativeAllocations.stats
        times[tool] << timed.(requests)
        stats[tool] << tracker_stats_since(warmed)
        samples[tool] += stats[tool].last[:samples]
        missed[tool] += stats[tool].last[:missed]
        RubySpy.stop_tracking_allocations
      when /\Astackprof:(\d+)\z/
        t = nil
        StackProf.run(mode: :object, interval: Integer($1)) { t = timed.(requests) }
        times[tool] << t
      when "memory_profiler"
        t = nil
        MemoryProfiler.report { t = timed.(requests / 10) * 10 }
        times[tool] << t
      end
    end
  end
  median = ->(a) { a.sort[a.size / 2] }
  base = median.(times["none"])
  puts format("Rails %s, Ruby %s: %d rounds of %d requests to /catalog (%d objects a request)",
              Rails.version, RUBY_VERSION, rounds, requests, per_request)
  times.each do |tool, list|
    m = median.(list)
    extra = if samples[tool].positive?
              format("  %6.1f samples a request, %.0f%% of points missed", samples[tool].to_f / (rounds * requests),
                     100.0 * missed[tool] / samples[tool])
            else
              ""
            end
    # Each round's window against the same round's untracked one: a drift of the machine's
    # speed over the run moves both.
    paired = list.zip(times["none"]).map { |t, n| 100 * (t / n - 1) }
    if tool != "none"
      extra = format("  (paired %+.1f%%, %+.1f..%+.1f; 95%% interval for its median %+.1f..%+.1f)%s", median.(paired),
                     paired.min, paired.max, *median_ci(paired)[1..], extra)
    end
    puts format("  %-18s %8.3f ms CPU a request  %+7.1f%%%s", tool, m * 1000 / requests, 100 * (m / base - 1), extra)
    next if stats[tool].empty?

    # What the tracker's machinery did (RubySpy::NativeAllocations.stats, as bench/alloc_cost.rb
    # prints it): medians over the windows.
    per_s = ->(key) { median.(stats[tool].map { |s| s.fetch(key, 0) / s[:seconds] }) }
    each_us = ->(ns, n) { median.(stats[tool].map { |s| s[n].positive? ? s[ns] / s[n] / 1000 : 0 }) }
    puts format("  %-18s own measure %.2f %% of a core; hook calls %.0f/s, armed %.1f %% of the time, " \
                "%.0f turns/s at %.1f µs; wake-ups %.0f/s; jobs %.0f/s at %.1f µs; hook %.0f µs/s; " \
                "publications %.1f/s at %.0f µs; margin at the end %.0f µs", "", per_s.(:priced_ns) / 1e7, per_s.(:hook_calls),
                per_s.(:armed_ns) / 1e7, per_s.(:arms), each_us.(:switch_ns, :arms), per_s.(:wakes), per_s.(:jobs),
                each_us.(:job_ns, :jobs), per_s.(:hook_ns) / 1000, per_s.(:publishes), each_us.(:publish_ns, :publishes),
                median.(stats[tool].map { |s| s.fetch(:ahead_us, 0) }))
  end
RUBY

Dir.mktmpdir("rbspy-allocs-rails") do |dir|
  app = File.join(dir, "rails_app")
  system(RbConfig.ruby, File.join(ROOT, "spec/fixtures/rails_app/generate"), app, exception: true)
  env = { "BUNDLE_GEMFILE" => File.join(app, "Gemfile"), "RAILS_ENV" => "production", "ROUNDS" => rounds.to_s,
          "REQUESTS" => requests.to_s, "STACKPROF_DIR" => STACKPROF, "MEMORY_PROFILER" => MEMORY_PROFILER,
          "SECRET_KEY_BASE" => "bench" * 8, "TOOLS" => ENV.fetch("TOOLS", nil), "WARMUP" => ENV.fetch("WARMUP", "1"),
          "BENCH_SUPPORT" => File.join(__dir__, "support.rb") }
  out, status = Open3.capture2e(env, RbConfig.ruby, "-rbundler/setup", "-e", LOOP, chdir: app)
  puts out
  exit(status.exitstatus || 1)
end
