# frozen_string_literal: true

desc "Run all specs (after compile); SPEC_OPTS=... passes options to rspec"
task spec: :compile do
  sh "rspec"
end

desc "cargo test --workspace"
task :cargo_test do
  sh "cargo", "test", "--workspace"
end

desc "cargo fmt --check and clippy with warnings as errors"
task :lint do
  sh "cargo", "fmt", "--all", "--check"
  sh "cargo", "clippy", "--workspace", "--all-targets", "--", "-D", "warnings"
end
