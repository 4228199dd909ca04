-- Whether the user may publish and subscribe on the channels ARGV names: '' when it may,
-- or the first refusal. KEYS[1] (the lock) only routes the call to the lock's server.
-- Redis before 7.0 has no acl_check_cmd, and no channel permissions to refuse.
if not redis.acl_check_cmd then
    return ''
end
for i = 1, #ARGV do
    if not redis.acl_check_cmd('publish', ARGV[i], '0') then
        return 'publish to ' .. ARGV[i]
    end
    if not redis.acl_check_cmd('subscribe', ARGV[i]) then
        return 'subscribe to ' .. ARGV[i]
    end
end
return ''
